//! The `shardline` command line's entry point, shared by every binary that
//! runs it: the `shardline` binary, and `shardline-bench`, which starts the
//! nodes of its local clusters by running itself as `shardline-bench node
//! ...` (one build for the bench and its nodes).

use std::ffi::OsString;
use std::fmt::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Shardline: a cluster-sharding message-routing engine.
#[derive(Parser)]
#[command(name = "shardline", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the version and exit.
    Version,
    /// Print the shard of each entity id (`ID SHARD` lines).
    ShardOf(super::shard_of::ShardOfArgs),
    /// Run a node: `shardline node --config FILE`.
    Node(super::node::NodeArgs),
    /// Print a node's view of the cluster: `shardline status --node ADDR`
    /// (`--allocation`: the coordinators' allocation table).
    Status(super::status::StatusArgs),
    /// Run one rebalance round of the coordinator now:
    /// `shardline rebalance --node ADDR [--type T]`.
    Rebalance(super::rebalance::RebalanceArgs),
    /// Journal tools for a stopped node's journal: `verify DIR`, `inspect
    /// DIR`, `repair DIR --yes`.
    Journal(super::journal::JournalArgs),
}

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Runs the `shardline` command line on `args` (`args[0]` is the program
/// name, as in [`std::env::args_os`]) and returns the process's exit code.
///
/// Exit codes: 0 on success (`shardline node`: after a graceful leave on
/// SIGTERM/SIGINT); 1 when the command fails (the error and its causes are
/// printed on stderr as `Error: ...`, followed by `Caused by:` lines) and
/// when `shardline journal verify` or `inspect` finds a corruption; 2 for invalid
/// arguments (clap's usage error, printed on stderr). A closed stdout
/// (`shardline status | head`) ends the output quietly with 0.
///
/// `shardline node` logs to stderr through `tracing` (filter from
/// `RUST_LOG`, default `info`) and prints `shardline: ready ...` on stdout
/// when the node is routable (see [`super::node::run`]). The caller's
/// binary chooses the global allocator (both Shardline binaries use
/// mimalloc).
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match run(Cli::parse_from(args)) {
        Ok(code) => code,
        // A closed stdout (`shardline status | head`) ends the output quietly.
        Err(e) if is_broken_pipe(e.as_ref()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", report(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, BoxError> {
    match cli.command {
        Command::Version => {
            println!("shardline {}", env!("CARGO_PKG_VERSION"));
        }
        Command::Node(args) => {
            // Huge-page faults stall a data core for milliseconds when its
            // tables grow (see the function's doc); log and go on if refused.
            if let Err(e) = crate::runtime::disable_transparent_huge_pages() {
                eprintln!("shardline: transparent huge pages stay on: {e}");
            }
            // `try_init`: a process that already set a subscriber keeps it.
            let fmt = tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr);
            let _ = match args.log_format {
                super::node::LogFormat::Text => fmt
                    // Colour codes only for a terminal: a log file or a
                    // pipe gets plain text.
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .try_init(),
                super::node::LogFormat::Json => fmt.json().with_ansi(false).try_init(),
            };
            if let Err(e) = super::node::run(&args) {
                if args.log_format == super::node::LogFormat::Json {
                    // The reason for the exit is one JSON line like the
                    // rest of the log, not text a log collector cannot read.
                    tracing::error!(error = %report(&e), "the node exits with an error");
                    return Ok(ExitCode::FAILURE);
                }
                return Err(e.into());
            }
        }
        Command::Status(args) => super::status::run(&args, &mut std::io::stdout().lock())?,
        Command::Rebalance(args) => super::rebalance::run(&args, &mut std::io::stdout().lock())?,
        Command::Journal(args) => {
            if !super::journal::run(&args, &mut std::io::stdout().lock())? {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::ShardOf(args) => super::shard_of::run(&args, &mut std::io::stdout().lock())?,
    }
    Ok(ExitCode::SUCCESS)
}

fn chain<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let broken = |io: &std::io::Error| io.kind() == std::io::ErrorKind::BrokenPipe;
    chain(e).any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(broken)
            // `CliError::Io` is transparent: the I/O error is not its
            // source, so the chain never shows it.
            || matches!(c.downcast_ref::<super::CliError>(), Some(super::CliError::Io(io)) if broken(io))
    })
}

/// The error and its causes, laid out as `anyhow` prints an error returned
/// from `main` (`{error}`, then `Caused by:` and one indented line per
/// cause, numbered when there are several).
fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let causes: Vec<String> = chain(e).skip(1).map(|c| c.to_string()).collect();
    if !causes.is_empty() {
        out.push_str("\n\nCaused by:");
        let numbered = causes.len() > 1;
        for (n, cause) in causes.iter().enumerate() {
            out.push('\n');
            for (i, line) in cause.split('\n').enumerate() {
                if i > 0 {
                    out.push_str(if numbered { "\n       " } else { "\n    " });
                } else if numbered {
                    let _ = write!(out, "{n:>5}: ");
                } else {
                    out.push_str("    ");
                }
                out.push_str(line);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn errors_print_with_their_causes_and_broken_pipes_are_quiet() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(report(&e), "outer\n\nCaused by:\n    inner");
        assert!(!is_broken_pipe(&e));
        let pipe = Outer(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(is_broken_pipe(&pipe));
        // As a command returns it (`status ... | head -1`).
        let boxed: BoxError =
            super::super::CliError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
                .into();
        assert!(is_broken_pipe(&*boxed));
        let boxed: BoxError = super::super::CliError::from(std::io::Error::other("disk")).into();
        assert!(!is_broken_pipe(&*boxed));
    }

    #[test]
    fn commands_exit_zero_or_one() {
        assert_eq!(main(["shardline", "version"]), ExitCode::SUCCESS);
        assert_eq!(
            main(["shardline", "shard-of", "--shards", "10", "a"]),
            ExitCode::SUCCESS
        );
        assert_eq!(
            main(["shardline", "shard-of", "--shards", "0", "a"]),
            ExitCode::FAILURE
        );
    }
}
