//! `sim`: runs the deterministic sharding simulation over many seeds.
//!
//! `cargo run --release -p shardline-tests --bin sim -- --seeds 200`
//! prints one line per scenario and ends with `N seeds, V violations`; it
//! exits 1 on any violation, printing the seed, the scenario, the invariant
//! and the last events. `--seed S --scenario NAME` replays one run exactly.
//! Seeds run on every available core (`--threads` to choose); each line
//! gives the rate in seeds/s, so a long sweep is one command
//! (`scripts/sim-sweep`, see tests/SIMULATION.md).

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Parser;
use shardline_tests::sim::{membership, run, Scenario, SimConfig, OPEN_SCENARIOS, SCENARIOS};

/// Deterministic simulation of Shardline's cluster sharding.
#[derive(Parser, Debug)]
#[command(name = "sim")]
struct Args {
    /// Seeds per scenario.
    #[arg(long, default_value_t = 200)]
    seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    start_seed: u64,
    /// Replay exactly this one seed (with --scenario, one run).
    #[arg(long)]
    seed: Option<u64>,
    /// Only this scenario (see --list).
    #[arg(long)]
    scenario: Option<String>,
    /// Nodes at the start.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Data cores (regions) per node.
    #[arg(long, default_value_t = 2)]
    cores: usize,
    /// Print the scenario names and exit.
    #[arg(long)]
    list: bool,
    /// Worker threads (default: every available core).
    #[arg(long)]
    threads: Option<usize>,
}

struct Failure {
    scenario: &'static str,
    seed: u64,
}

fn main() -> Result<ExitCode> {
    let args = Args::parse();
    if args.list {
        for s in SCENARIOS {
            println!("{:<26} {}", s.name, s.about);
        }
        for s in OPEN_SCENARIOS {
            println!("{:<26} {} (only with --scenario)", s.name, s.about);
        }
        membership::list_membership_scenarios();
        return Ok(ExitCode::SUCCESS);
    }
    if args.nodes < 2 || args.cores < 1 {
        bail!("--nodes must be at least 2 and --cores at least 1");
    }
    let cfg = SimConfig {
        nodes: args.nodes,
        cores: args.cores,
        ..SimConfig::default()
    };
    let scenarios: Vec<&'static Scenario> = match &args.scenario {
        Some(name) => match SCENARIOS
            .iter()
            .chain(OPEN_SCENARIOS)
            .find(|s| s.name == name)
        {
            Some(s) => vec![s],
            None if membership::is_membership_scenario(name) => Vec::new(),
            None => bail!("unknown scenario {name:?}; see --list"),
        },
        None => SCENARIOS.iter().collect(),
    };
    let seeds: Vec<u64> = match args.seed {
        Some(s) => vec![s],
        None => (args.start_seed..args.start_seed + args.seeds).collect(),
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let started = Instant::now();
    let mut failures: Vec<Failure> = Vec::new();
    let mut runs = 0u64;
    for sc in &scenarios {
        let t0 = Instant::now();
        let next = AtomicU64::new(0);
        let results: Vec<(u64, shardline_tests::sim::RunOutcome)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                            let Some(&seed) = seeds.get(i) else { break };
                            out.push((seed, run(sc, seed, &cfg, false)));
                        }
                        out
                    })
                })
                .collect();
            let mut all: Vec<_> = handles
                .into_iter()
                .flat_map(|h| h.join().expect("simulation thread"))
                .collect();
            all.sort_by_key(|(s, _)| *s);
            all
        });
        let mut v = 0;
        let (mut sent, mut delivered, mut full, mut lost, mut steps) = (0, 0, 0, 0, 0);
        let (mut dealloc, mut stops, mut coords, mut allocs) = (0, 0, 0, 0);
        for (seed, o) in &results {
            runs += 1;
            sent += o.stats.sent;
            delivered += o.stats.delivered;
            full += o.stats.buffer_full;
            lost += o.stats.lost_with_node;
            steps += o.stats.steps;
            dealloc += o.stats.deallocations;
            stops += o.stats.stops;
            coords += o.stats.coordinator_starts;
            allocs += o.stats.allocations;
            if o.violation.is_some() {
                v += 1;
                failures.push(Failure {
                    scenario: sc.name,
                    seed: *seed,
                });
            }
        }
        println!(
            "{:<26} {} seeds, {v} violations  (sent {sent}, processed {delivered}, buffer-full {full}, lost with node {lost}; allocations {allocs}, deallocations {dealloc}, entity stops {stops}, coordinator starts {coords}; steps {steps}) {:.1}s, {:.0} seeds/s",
            sc.name,
            results.len(),
            t0.elapsed().as_secs_f64(),
            rate(results.len() as u64, t0.elapsed().as_secs_f64())
        );
    }
    for f in &failures {
        println!("FAILED scenario {} seed {}", f.scenario, f.seed);
    }
    for f in failures.iter().take(3) {
        let sc = SCENARIOS
            .iter()
            .chain(OPEN_SCENARIOS)
            .find(|s| s.name == f.scenario)
            .expect("known");
        let o = run(sc, f.seed, &cfg, true);
        let v = o.violation.expect("deterministic replay violates again");
        println!();
        println!(
            "VIOLATION seed {} scenario {} invariant {:?} at {:.3}s: {}",
            f.seed,
            f.scenario,
            v.invariant,
            v.at.as_secs_f64(),
            v.detail
        );
        println!(
            "replay: cargo run --release -p shardline-tests --bin sim -- --scenario {} --seed {} --nodes {} --cores {}",
            f.scenario, f.seed, cfg.nodes, cfg.cores
        );
        println!("last events:");
        for line in &o.last_events {
            println!("  {line}");
        }
    }
    // The membership scenarios (gossip, failure detection, split-brain
    // resolver) run in their own world: shardline_tests::sim::membership.
    let (m_runs, m_violations) =
        membership::run_membership_cli(args.scenario.as_deref(), &seeds, threads);
    runs += m_runs;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{runs} seeds, {} violations ({secs:.1}s, {:.0} seeds/s on {threads} threads)",
        failures.len() as u64 + m_violations,
        rate(runs, secs)
    );
    Ok(if failures.is_empty() && m_violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Seeds per second (count / s), 0 when no time passed.
fn rate(seeds: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        seeds as f64 / secs
    } else {
        0.0
    }
}
