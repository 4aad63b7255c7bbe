//! `shardline-bench demo`: the main job in one command.
//!
//! Spawns a three-node local cluster, replays the OLTP trace of the ARC paper
//! against counter entities (one `add 1` per page reference, entity = page
//! number), verifies every counter, prints the latency histogram and writes
//! `demo.hgrm`, `demo.json` and `demo.svg`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::{Args, Parser};

use crate::run::{run, RunArgs, RunReport};
use crate::transport::Connector;

/// The OLTP trace shipped in this crate (see `data/README.md`).
pub const OLTP_TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/OLTP.lis.zst");

/// Options of `shardline-bench demo`.
#[derive(Args, Clone, Debug)]
pub struct DemoArgs {
    /// Nodes of the local cluster.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Replay at most this many page references (the trace has 914,145).
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Stop replaying after this long (the demo must stay short on a 2-core machine).
    #[arg(long, default_value = "150s")]
    pub max_duration: String,
    /// Open-loop rate (requests/s in total; latency counted from each request's
    /// intended send time). 0 = closed loop, as fast as the cluster answers.
    #[arg(long, default_value_t = 20_000.0)]
    pub rate: f64,
    /// Most requests in flight per connection (one connection per node).
    #[arg(long, default_value_t = 64)]
    pub pipeline: usize,
    /// Durability of the counters' nodes: none, always or interval:MS.
    #[arg(long, default_value = "none")]
    pub durability: String,
    /// Directory for demo.hgrm, demo.json and demo.svg.
    #[arg(long, default_value = ".")]
    pub out_dir: PathBuf,
    /// The trace to replay.
    #[arg(long, default_value = OLTP_TRACE)]
    pub trace: PathBuf,
    /// No live progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Start the load as soon as the nodes report ready instead of once
    /// the shards are balanced (see `run --load-at-ready`).
    #[arg(long)]
    pub load_at_ready: bool,
}

#[derive(Parser)]
struct RunOnly {
    #[command(flatten)]
    args: RunArgs,
}

/// The `run` options the demo stands for.
///
/// # Errors
/// When an option value is refused by `run`'s parser.
pub fn run_args(demo: &DemoArgs) -> Result<RunArgs> {
    let out = |name: &str| demo.out_dir.join(name).to_string_lossy().into_owned();
    let mut line: Vec<String> = vec![
        "run".into(),
        "--spawn".into(),
        demo.nodes.to_string(),
        "--trace".into(),
        demo.trace.to_string_lossy().into_owned(),
        "--op".into(),
        "counter-add".into(),
        "--verify".into(),
        "--pipeline".into(),
        demo.pipeline.to_string(),
        "--duration".into(),
        demo.max_duration.clone(),
        "--durability".into(),
        demo.durability.clone(),
        "--hgrm".into(),
        out("demo.hgrm"),
        "--json".into(),
        out("demo.json"),
        "--plot".into(),
        out("demo.svg"),
    ];
    if demo.rate > 0.0 {
        line.push("--rate".into());
        line.push(demo.rate.to_string());
    }
    if let Some(max) = demo.max_requests {
        line.push("--max-requests".into());
        line.push(max.to_string());
    }
    if demo.no_progress {
        line.push("--no-progress".into());
    }
    if demo.load_at_ready {
        line.push("--load-at-ready".into());
    }
    Ok(RunOnly::try_parse_from(line)?.args)
}

/// Runs the demo and prints what it did.
///
/// # Errors
/// As [`run`]; also when the trace is missing.
pub fn demo(args: DemoArgs, connector: Arc<dyn Connector>) -> Result<RunReport> {
    if !args.trace.is_file() {
        bail!(
            "trace {} not found (it ships in bench-harness/data/)",
            args.trace.display()
        );
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let pace = if args.rate > 0.0 {
        format!(
            "open loop at {} requests/s (latency from each request's intended send time), at most {} in flight per node",
            args.rate, args.pipeline
        )
    } else {
        format!("closed loop, {} in flight per node", args.pipeline)
    };
    println!(
        "demo: a {}-node local cluster; replaying the OLTP trace (ARC paper, Megiddo & Modha, FAST '03: \
         914,145 references to 186,880 pages) as counter adds, one per reference, entity = page number; \
         {pace}; stopping at the trace's end or after {}{}, whichever comes first; then every counter is read back and checked.",
        args.nodes,
        args.max_duration,
        args.max_requests.map(|m| format!(" or {m} references")).unwrap_or_default()
    );
    let run_args = run_args(&args)?;
    let report = run(run_args, connector, "demo")?;
    println!();
    println!("latency histogram (ms, HdrHistogram percentile distribution, also in demo.hgrm):");
    let hgrm = std::fs::read_to_string(args.out_dir.join("demo.hgrm"))?;
    for line in hgrm.lines() {
        println!("{line}");
    }
    let replayed = report.sent;
    println!();
    println!(
        "demo: replayed {replayed} of 914145 trace references{} in {:.1} s wall time",
        if replayed < 914_145 {
            " (capped to keep the demo short)"
        } else {
            ""
        },
        report.wall_s
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_trace_is_there() {
        assert!(std::path::Path::new(OLTP_TRACE).is_file());
    }

    #[test]
    fn demo_maps_to_run_options() {
        let demo = DemoArgs {
            nodes: 3,
            max_requests: Some(1000),
            max_duration: "60s".into(),
            rate: 1000.0,
            pipeline: 32,
            durability: "none".into(),
            out_dir: PathBuf::from("/tmp/out"),
            trace: PathBuf::from(OLTP_TRACE),
            no_progress: true,
            load_at_ready: false,
        };
        let a = run_args(&demo).unwrap();
        assert_eq!(a.spawn, Some(3));
        assert!(a.verify);
        assert_eq!(a.max_requests, Some(1000));
        assert_eq!(a.pipeline, 32);
        assert_eq!(a.rate, Some(1000.0));
        assert_eq!(a.json, Some(PathBuf::from("/tmp/out/demo.json")));
        assert_eq!(a.duration, Some(std::time::Duration::from_secs(60)));
        assert!(!a.load_at_ready);
        let a = run_args(&DemoArgs {
            load_at_ready: true,
            ..demo
        })
        .unwrap();
        assert!(a.load_at_ready);
    }
}
