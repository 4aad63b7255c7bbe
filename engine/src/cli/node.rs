//! `shardline node --config FILE`: runs one node until SIGTERM/SIGINT, then
//! leaves the cluster gracefully and exits 0.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::config::NodeConfig;
use crate::node::Node;

/// Arguments of `shardline node`.
#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    /// The node's TOML configuration file.
    #[arg(long)]
    pub config: PathBuf,
    /// How long the graceful leave may take after SIGTERM, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub leave_timeout_ms: u64,
    /// The log's format on stderr: `text` (one line per event, for people)
    /// or `json` (one JSON object per line, for a log collector: `timestamp`,
    /// `level`, `target`, `fields` with the message and the event's fields).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// The format of `shardline node`'s log (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    Text,
    /// One JSON object per line (tracing-subscriber's JSON format).
    Json,
}

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

/// Runs the node. Prints `shardline: ready client_address=...` on stdout once
/// the member is Up and its regions are registered.
///
/// # Errors
/// A bad config (with file, key and reason), a `data_dir` in use by another
/// process (with its pid) or recorded for another cluster, a bind failure,
/// the node refusing to join (another cluster, or members whose journals it
/// cannot share: the reason names `journal.backend`), or the node being
/// downed by the cluster.
pub fn run(args: &NodeArgs) -> Result<(), super::CliError> {
    let cfg = NodeConfig::from_file(&args.config)?;
    // Every connection is a descriptor: a node started by systemd would
    // otherwise have 1024 (see the function's doc).
    match crate::runtime::raise_open_file_limit() {
        Ok((soft, hard)) => tracing::info!(soft, hard, "open file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open file limit"),
    }
    install_signal_handlers();
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| {
        super::CliError::Stopped(format!(
            "{}: key `data_dir`: cannot create {}: {e}",
            args.config.display(),
            cfg.data_dir.display()
        ))
    })?;
    let client_address = cfg.client_address;
    let cluster_address = cfg.cluster_address;
    let node = Node::start(cfg)?;
    tracing::info!(%cluster_address, %client_address, uid = node.uid().0, "node started");
    let mut ready = false;
    loop {
        if SIGNALLED.load(Ordering::SeqCst) {
            tracing::info!("signal received: leaving the cluster");
            node.leave(Duration::from_millis(args.leave_timeout_ms));
            tracing::info!("left; exiting");
            return Ok(());
        }
        if node.is_stopped() {
            let downed = node.was_downed();
            let refusal = node.refusal();
            drop(node);
            if let Some(reason) = refusal {
                return Err(super::CliError::Stopped(format!(
                    "refused to join the cluster: {reason}"
                )));
            }
            if downed {
                return Err(super::CliError::Stopped(
                    "this node was downed by the cluster".into(),
                ));
            }
            return Ok(());
        }
        if !ready && node.wait_ready(Duration::from_millis(50)).is_ok() {
            ready = true;
            println!("shardline: ready client_address={client_address} cluster_address={cluster_address}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        } else {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
