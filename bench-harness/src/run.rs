//! `shardline-bench run`: target, load, scenario, verification and reports.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::cluster::{node_binary, Durability, LocalCluster, NodeSpec};
use crate::driver::{Driver, DriverConfig, LoopMode, Outcome};
use crate::plot::{Mark, PlotTitle, Timeline};
use crate::report::{LatencySummary, Machine};
use crate::transport::{sum_field, Connector};
use crate::units::{format_latency_us, parse_duration};
use crate::verify::{judge, Verdict};
use crate::workload::{
    partition_shares, split_by_shares, KeyDist, OpKind, OpMix, Request, RequestSource, Workload,
};

/// A disturbance during the run (needs `--spawn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// No disturbance.
    Steady,
    /// A node joins a third of the way through the measured time.
    Rebalance,
    /// The last node is killed with SIGKILL at one third and restarted at two
    /// thirds of the measured time.
    Failover,
    /// Each node in turn is stopped with SIGTERM and restarted, from one
    /// sixth of the measured time on.
    RollingRestart,
}

/// Passivation strategy for `--active-entity-limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Passivation {
    /// Least recently used first (the node's only strategy so far).
    Lru,
}

/// Options of `shardline-bench run`.
#[derive(Args, Clone, Debug, Serialize)]
pub struct RunArgs {
    /// Client addresses of a running cluster (comma-separated host:port).
    #[arg(long, value_delimiter = ',', conflicts_with = "spawn")]
    pub connect: Vec<SocketAddr>,
    /// Start a local cluster of N nodes (the default is 1 when --connect is not given).
    #[arg(long)]
    pub spawn: Option<usize>,
    /// Data cores (regions) per spawned node.
    #[arg(long, default_value_t = 1)]
    pub cores: u16,
    /// Pin the spawned nodes' executors to cores.
    #[arg(long)]
    pub pin_cores: bool,
    /// Shards per entity type on spawned nodes.
    #[arg(long, default_value_t = 100)]
    pub shards: u32,
    /// Open loop at R requests/s in total (latency from each request's intended send time).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Closed loop with C requests in flight in total [default: connections x pipeline].
    #[arg(long, conflicts_with = "rate")]
    pub concurrency: Option<usize>,
    /// Measured time after the warm-up [default: 10s; a trace runs to its end].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Warm-up before the measured time (not in the summary).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub warmup: Duration,
    /// Connections [default: one per node].
    #[arg(long)]
    pub connections: Option<usize>,
    /// Most requests in flight per connection (open loop; closed loop without --concurrency).
    #[arg(long, default_value_t = 64)]
    pub pipeline: usize,
    /// Entities of the synthetic workload.
    #[arg(long, default_value_t = 10_000)]
    pub entities: u64,
    /// Key distribution: uniform or zipf:S.
    #[arg(long, value_parser = KeyDist::parse, default_value = "uniform")]
    pub dist: KeyDist,
    /// Replay an ARC trace (.lis or .lis.zst): one message per page reference, entity = page number.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Stop after this many requests in total.
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Request kind: echo, counter-add, counter-get or mix:add=90,get=10,echo=0.
    #[arg(long, value_parser = OpMix::parse, default_value = "echo")]
    pub op: OpMix,
    /// Read every counter at the end and check it equals the acknowledged adds.
    #[arg(long)]
    pub verify: bool,
    /// Disturbance during the run (needs --spawn).
    #[arg(long, value_enum, default_value = "steady")]
    pub scenario: Scenario,
    /// Active entities per region before passivation (spawned nodes; 0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub active_entity_limit: u64,
    /// Passivation strategy used with --active-entity-limit.
    #[arg(long, value_enum, default_value = "lru")]
    pub passivation: Passivation,
    /// Idle passivation timeout of spawned nodes (0 disables).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub idle_timeout: Duration,
    /// Durability of spawned nodes: none, always or interval:MS.
    #[arg(long, value_parser = Durability::parse, default_value = "none")]
    pub durability: Durability,
    /// A connection with requests waiting and no reply for this long is declared dead.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub request_timeout: Duration,
    /// Seed of the synthetic workload's random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the latency histogram in HdrHistogram's percentile-distribution text format.
    #[arg(long)]
    pub hgrm: Option<PathBuf>,
    /// Write every figure, the configuration and the machine as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the plot (.svg or .png): latency by percentile, and p50, p99 and max per second with the scenario's events (log latency axes, ms).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// No live progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Start the load as soon as every spawned node reports ready, without
    /// first waiting until the joiners' share of the shards was handed to
    /// them (the first seed starts alone and gets every shard): the first
    /// seconds then include those rebalance hand-offs.
    #[arg(long)]
    pub load_at_ready: bool,
}

/// Set by the SIGINT handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    // A second Ctrl-C ends the process the default way.
    // SAFETY: signal(2) is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

fn install_sigint() {
    // SAFETY: installs a handler that only stores to an atomic and resets
    // the disposition, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
}

/// Figures of one second of the run.
#[derive(Clone, Debug, Serialize)]
pub struct SecondFigures {
    /// Second since the start of the run (by intended send time).
    pub t_s: u64,
    /// Successes intended in that second (count).
    pub ok: u64,
    /// Errors intended in that second (count).
    pub errors: u64,
    /// Median (µs).
    pub p50_us: u64,
    /// 99th percentile (µs).
    pub p99_us: u64,
    /// Highest (µs).
    pub max_us: u64,
}

/// Everything `--json` writes.
#[derive(Serialize)]
pub struct RunReport {
    /// Which command produced it.
    pub command: String,
    /// Machine and build.
    pub machine: Machine,
    /// The options.
    pub config: RunArgs,
    /// Spawned node settings, when the harness started the cluster.
    pub node_spec: Option<NodeSpec>,
    /// Client addresses used.
    pub addresses: Vec<SocketAddr>,
    /// Loop, connections, windows and rates as applied.
    pub applied: String,
    /// Requests sent, warm-up included (count).
    pub sent: u64,
    /// Successes after warm-up (count).
    pub ok: u64,
    /// Errors after warm-up (count).
    pub errors: u64,
    /// Errors after warm-up by kind (count).
    pub errors_by_kind: HashMap<String, u64>,
    /// Successes during warm-up (count).
    pub ok_warmup: u64,
    /// Errors during warm-up (count).
    pub errors_warmup: u64,
    /// Measured time: from the end of warm-up to the last measured completion (s).
    pub measured_s: f64,
    /// Successes per second of measured time (requests/s).
    pub throughput_per_s: f64,
    /// Latency of successes after warm-up, from intended send time (µs).
    pub latency: LatencySummary,
    /// Per-second figures, warm-up included.
    pub per_second: Vec<SecondFigures>,
    /// Longest time one entity could not be reached (ms).
    pub longest_unreachable_ms: f64,
    /// The entity of that window.
    pub longest_unreachable_entity: Option<u64>,
    /// Scenario events (seconds since start).
    pub events: Vec<(f64, String)>,
    /// The counter verification, with `--verify`.
    pub verify: Option<Verdict>,
    /// Messages delivered to entities during the load, from node status (count).
    pub messages_delivered: Option<u64>,
    /// Entities activated during the load, from node status (count).
    pub entities_activated: Option<u64>,
    /// Messages the regions refused during the load, from node status (count).
    pub dead_letters: Option<u64>,
    /// Share of messages that found their entity active (percent):
    /// `100 * (delivered - activated) / delivered`.
    pub hit_ratio: Option<f64>,
    /// Wall time of the whole run including verification (s).
    pub wall_s: f64,
}

/// Hit ratio in percent from node counters (`None` when nothing was delivered).
pub fn hit_ratio(delivered: u64, activated: u64) -> Option<f64> {
    (delivered > 0).then(|| 100.0 * delivered.saturating_sub(activated) as f64 / delivered as f64)
}

enum Step {
    Kill(usize),
    Start(usize),
    Terminate(usize),
    WaitReady(usize),
}

struct Plan {
    steps: Vec<(Duration, Step)>,
}

impl Plan {
    /// Steps with their delay: the first relative to the start of the run,
    /// every other one relative to the end of the step before.
    fn new(scenario: Scenario, nodes: usize, warmup: Duration, duration: Duration) -> Plan {
        let third = duration / 3;
        let last = nodes - 1;
        let steps = match scenario {
            Scenario::Steady => Vec::new(),
            Scenario::Rebalance => vec![
                (warmup + third, Step::Start(nodes)),
                (Duration::ZERO, Step::WaitReady(nodes)),
            ],
            Scenario::Failover => vec![
                (warmup + third, Step::Kill(last)),
                (third, Step::Start(last)),
                (Duration::ZERO, Step::WaitReady(last)),
            ],
            Scenario::RollingRestart => {
                let gap = duration / (3 * nodes as u32).max(1);
                let mut steps = Vec::new();
                for i in 0..nodes {
                    let delay = if i == 0 { warmup + duration / 6 } else { gap };
                    steps.push((delay, Step::Terminate(i)));
                    steps.push((Duration::ZERO, Step::Start(i)));
                    steps.push((Duration::ZERO, Step::WaitReady(i)));
                }
                steps
            }
        };
        Plan { steps }
    }
}

/// `(messages_delivered, entities_activated, dead_letters)` summed over the
/// regions of every node (each node reports its own regions).
fn node_counters(connector: &dyn Connector, addrs: &[SocketAddr]) -> Option<(u64, u64, u64)> {
    let mut sums = (0, 0, 0);
    for addr in addrs {
        let status = connector.node_status(*addr, Duration::from_secs(5)).ok()?;
        sums.0 += sum_field(&status, "messages_delivered");
        sums.1 += sum_field(&status, "entities_activated");
        sums.2 += sum_field(&status, "dead_letters");
    }
    Some(sums)
}

/// Reads the counters of `entities` with `get` (closed loop, retried up to
/// three times for the ones that failed). Missing = could not be read.
fn read_counters(
    connector: &Arc<dyn Connector>,
    addrs: &[SocketAddr],
    entities: &[u64],
    timeout: Duration,
) -> Result<HashMap<u64, Option<i64>>> {
    let mut values: HashMap<u64, i64> = HashMap::new();
    let mut remaining: Vec<u64> = entities.to_vec();
    for attempt in 0..3 {
        if remaining.is_empty() {
            break;
        }
        if attempt > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let conns = addrs.len().min(remaining.len()).max(1);
        let mut parts: Vec<Vec<Request>> = vec![Vec::new(); conns];
        for (i, e) in remaining.iter().enumerate() {
            parts[i % conns].push(Request {
                entity: *e,
                op: OpKind::CounterGet,
            });
        }
        let sources = parts
            .into_iter()
            .map(|p| {
                Box::new(p.into_iter().map(Ok)) as Box<dyn Iterator<Item = Result<Request>> + Send>
            })
            .collect();
        let config = DriverConfig {
            addresses: addrs.to_vec(),
            mode: LoopMode::Closed,
            rates_per_s: vec![0.0; conns],
            windows: vec![128; conns],
            quotas: vec![u64::MAX; conns],
            warmup: Duration::ZERO,
            duration: None,
            request_timeout: timeout,
            capture_values: true,
        };
        let out = Driver::start(
            config,
            connector.clone(),
            sources,
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        )
        .join()?;
        values.extend(out.recorder.values.unwrap_or_default());
        remaining.retain(|e| !values.contains_key(e));
    }
    Ok(entities
        .iter()
        .map(|e| (*e, values.get(e).copied()))
        .collect())
}

/// Unique entities a workload can touch (for the baseline read with --connect).
fn universe(workload: &Workload) -> Result<Vec<u64>> {
    match workload {
        Workload::Synthetic { entities, .. } => Ok((0..*entities).collect()),
        Workload::Trace { path } => {
            let mut seen = std::collections::HashSet::new();
            for page in crate::trace::TraceReader::open(path)? {
                seen.insert(page?);
            }
            Ok(seen.into_iter().collect())
        }
    }
}

/// Runs `shardline-bench run` and returns the report; prints the summary.
///
/// # Errors
/// Bad option combinations, a cluster that does not start, a malformed
/// trace, or an output file that cannot be written. A failed verification
/// is not an error here: see `RunReport::verify`.
pub fn run(args: RunArgs, connector: Arc<dyn Connector>, command: &str) -> Result<RunReport> {
    let wall = Instant::now();
    install_sigint();
    if args.spawn.is_some_and(|n| n == 0) {
        bail!("--spawn needs at least 1 node");
    }
    if args.scenario != Scenario::Steady && !args.connect.is_empty() {
        bail!(
            "--scenario {:?} needs --spawn (the harness must own the nodes)",
            args.scenario
        );
    }
    if args.scenario == Scenario::Failover && args.spawn.unwrap_or(1) < 2 {
        bail!("--scenario failover needs --spawn 2 or more");
    }
    if args.verify && !args.op.has_adds() {
        bail!("--verify needs counter adds (--op counter-add or a mix with add)");
    }
    if args.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        bail!("--rate must be a positive number of requests per second");
    }
    let mut trace_references = None;
    let workload = match &args.trace {
        Some(path) => {
            // One pass to find a malformed line before anything starts, and to
            // size the progress display.
            let mut references = 0u64;
            for page in crate::trace::TraceReader::open(path)? {
                page?;
                references += 1;
            }
            trace_references = Some(references);
            Workload::Trace { path: path.clone() }
        }
        None => Workload::Synthetic {
            entities: args.entities.max(1),
            dist: args.dist,
        },
    };
    let duration = match (&args.trace, args.duration) {
        (_, Some(d)) => Some(d),
        (Some(_), None) => None,
        (None, None) => Some(Duration::from_secs(10)),
    };
    if args.scenario != Scenario::Steady && duration.is_none() {
        bail!("--scenario with --trace needs --duration");
    }

    // Target.
    let mut cluster = None;
    let mut node_spec = None;
    let addresses = if args.connect.is_empty() {
        let nodes = args.spawn.unwrap_or(1);
        let spec = NodeSpec {
            data_cores: args.cores.max(1),
            pin_cores: args.pin_cores,
            number_of_shards: args.shards,
            durability: args.durability.clone(),
            idle_timeout_ms: args.idle_timeout.as_millis() as u64,
            active_entity_limit: args.active_entity_limit,
            extra_toml: String::new(),
        };
        let binary = node_binary()?;
        let spare = usize::from(args.scenario == Scenario::Rebalance);
        let started = Instant::now();
        let mut attempt = 1;
        let c = loop {
            let mut c = LocalCluster::prepare(binary.clone(), nodes, spare, &spec)?;
            eprintln!(
                "starting {nodes} node(s) in {} ({} node) ...",
                c.dir().display(),
                binary.display()
            );
            match c.start_initial(connector.as_ref(), CLUSTER_FORMATION_TIMEOUT) {
                Ok(()) => break c,
                Err(error) if attempt < CLUSTER_START_ATTEMPTS => {
                    c.keep_files();
                    let text = format!("{error:#}");
                    eprintln!(
                        "warning: the cluster did not form (attempt {attempt} of {CLUSTER_START_ATTEMPTS}): {}; \
                         starting a fresh cluster",
                        text.lines().next().unwrap_or("")
                    );
                    attempt += 1;
                }
                Err(error) => {
                    c.keep_files();
                    return Err(error);
                }
            }
        };
        eprintln!("cluster ready in {:.1} s", started.elapsed().as_secs_f64());
        // The first seed started alone and got every shard: the joiners'
        // share moves by rebalance hand-offs, which must not fall into the
        // measured load (unless asked for: `--load-at-ready`).
        if args.load_at_ready {
            eprintln!("load starts now, at ready (the joiners' shards may still be handed off)");
        } else {
            match c.wait_balanced(connector.as_ref(), CLUSTER_FORMATION_TIMEOUT) {
                Ok(took) => eprintln!("shards balanced after {:.1} s more", took.as_secs_f64()),
                Err(error) => {
                    let mut c = c;
                    c.keep_files();
                    return Err(error);
                }
            }
        }
        for node in &c.nodes[..nodes] {
            eprintln!(
                "  {}: cluster {} client {}",
                node.name, node.cluster_address, node.client_address
            );
        }
        let addrs = c.client_addresses();
        cluster = Some(c);
        node_spec = Some(spec);
        addrs
    } else {
        args.connect.clone()
    };

    for addr in &addresses {
        connector
            .connect(*addr)
            .with_context(|| format!("node {addr} is not reachable"))?;
    }
    let connections = args.connections.unwrap_or(addresses.len()).max(1);
    let baseline = if args.verify && cluster.is_none() {
        eprintln!("reading counters before the run (--connect: they may not start at 0) ...");
        let entities = universe(&workload)?;
        read_counters(&connector, &addresses, &entities, args.request_timeout)?
            .into_iter()
            .filter_map(|(e, v)| v.map(|v| (e, v)))
            .collect()
    } else {
        HashMap::new()
    };

    // Load.
    let n = connections as u64;
    let mut sources: Vec<Box<dyn Iterator<Item = Result<Request>> + Send>> = Vec::new();
    for c in 0..n {
        sources.push(Box::new(RequestSource::new(
            &workload, &args.op, args.seed, c, n,
        )?));
    }
    let shares = partition_shares(&workload, n)?;
    let (mode, rates, windows) = match args.rate {
        Some(rate) => (
            LoopMode::Open,
            shares
                .iter()
                .map(|share| (rate * share).max(1e-3))
                .collect::<Vec<_>>(),
            vec![args.pipeline.max(1); connections],
        ),
        None => {
            let total = args
                .concurrency
                .unwrap_or(connections * args.pipeline.max(1))
                .max(connections);
            let windows = (0..connections)
                .map(|c| total / connections + usize::from(c < total % connections))
                .collect();
            (LoopMode::Closed, vec![0.0; connections], windows)
        }
    };
    let quotas: Vec<u64> = match args.max_requests {
        Some(max) => split_by_shares(max, &shares),
        None => vec![u64::MAX; connections],
    };
    let applied = match mode {
        LoopMode::Open => {
            let end_ns = duration
                .map(|d| (d + args.warmup).as_nanos() as u64)
                .unwrap_or(u64::MAX);
            let planned: u64 = rates
                .iter()
                .zip(&quotas)
                .map(|(r, q)| match duration {
                    Some(_) => crate::schedule::OpenLoopSchedule::new(0, *r)
                        .count_before(end_ns)
                        .min(*q),
                    None => *q,
                })
                .fold(0u64, |a, b| a.saturating_add(b));
            let planned = planned.min(trace_references.unwrap_or(u64::MAX));
            format!(
                "open loop at {} requests/s over {connections} connection(s), at most {} in flight each, {planned} requests planned",
                args.rate.unwrap_or(0.0),
                windows[0]
            )
        }
        LoopMode::Closed => format!(
            "closed loop, {} in flight over {connections} connection(s)",
            windows.iter().sum::<usize>()
        ),
    };
    let counters_before = node_counters(connector.as_ref(), &addresses);
    eprintln!("{applied}");
    let stop = Arc::new(AtomicBool::new(false));
    let origin = Instant::now();
    let config = DriverConfig {
        addresses: addresses.clone(),
        mode,
        rates_per_s: rates,
        windows,
        quotas,
        warmup: args.warmup,
        duration,
        request_timeout: args.request_timeout,
        capture_values: false,
    };
    let driver = Driver::start(config, connector.clone(), sources, origin, stop.clone());
    let mut plan = Plan::new(
        args.scenario,
        addresses.len(),
        args.warmup,
        duration.unwrap_or_default(),
    )
    .steps
    .into_iter();
    let mut marks: Vec<Mark> = Vec::new();
    let mut next_step = plan.next();
    let mut step_base = Duration::ZERO;
    let by_count = duration.is_none();
    let bar = match duration {
        Some(d) => progress_bar(args.no_progress, (d + args.warmup).as_secs().max(1), "s"),
        None => {
            let total = trace_references
                .unwrap_or(0)
                .min(args.max_requests.unwrap_or(u64::MAX));
            progress_bar(args.no_progress, total.max(1), "requests")
        }
    };
    let mut last_tick = Instant::now();
    let mut last_completed = 0u64;
    while !driver.is_finished() {
        if INTERRUPTED.load(Ordering::SeqCst) {
            driver.stop();
        }
        if let Some((delay, step)) = next_step.take() {
            if origin.elapsed() >= step_base + delay {
                let c = cluster
                    .as_mut()
                    .context("scenario without a spawned cluster")?;
                run_step(c, &step, connector.as_ref(), origin, &mut marks);
                step_base = origin.elapsed();
                next_step = plan.next();
            } else {
                next_step = Some((delay, step));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        if last_tick.elapsed() >= Duration::from_millis(500) {
            let p = driver.progress();
            let rate = (p.completed - last_completed) as f64 / last_tick.elapsed().as_secs_f64();
            last_completed = p.completed;
            last_tick = Instant::now();
            let p99 = if p.interval.is_empty() {
                "-".into()
            } else {
                format_latency_us(p.interval.value_at_percentile(99.0))
            };
            bar.set_position(if by_count {
                p.completed
            } else {
                origin.elapsed().as_secs()
            });
            bar.set_message(format!(
                "{} done, {rate:.0} req/s, current p99 {p99}",
                p.completed
            ));
        }
    }
    bar.finish_and_clear();
    let Outcome {
        recorder,
        sent,
        elapsed,
    } = driver.join()?;
    // Steps still due (a run that ended early) are carried out so the cluster is whole.
    if let Some((_, step)) = next_step {
        if let Some(c) = cluster.as_mut() {
            run_step(c, &step, connector.as_ref(), origin, &mut marks);
            for (_, step) in plan {
                run_step(c, &step, connector.as_ref(), origin, &mut marks);
            }
        }
    }
    let counters_after = node_counters(connector.as_ref(), &addresses);
    // Node counters restart from zero with a node, so they are only compared
    // across a run without restarts.
    let comparable = args.scenario == Scenario::Steady;
    let (delivered, activated, dead_letters) = match (counters_before, counters_after) {
        (Some(b), Some(a)) if comparable => (
            Some(a.0.saturating_sub(b.0)),
            Some(a.1.saturating_sub(b.1)),
            Some(a.2.saturating_sub(b.2)),
        ),
        _ => (None, None, None),
    };

    // Verify.
    let verdict = if args.verify {
        let mut entities: Vec<u64> = recorder.adds.keys().copied().collect();
        entities.sort_unstable();
        eprintln!("verifying {} counters ...", entities.len());
        let observed = read_counters(&connector, &addresses, &entities, args.request_timeout)?;
        Some(judge(&recorder.adds, &baseline, &observed))
    } else {
        None
    };

    // Report.
    let warmup_ns = args.warmup.as_nanos() as u64;
    let measured_s = (recorder.last_completion_ns.saturating_sub(warmup_ns)) as f64 / 1e9;
    let latency = LatencySummary::of(&recorder.histogram);
    let per_second: Vec<SecondFigures> = (0..recorder
        .per_second
        .len()
        .max(recorder.errors_per_second.len()))
        .map(|s| {
            let h = recorder.per_second.get(s);
            let summary = h.map(LatencySummary::of);
            SecondFigures {
                t_s: s as u64,
                ok: h.map(|h| h.len()).unwrap_or(0),
                errors: recorder.errors_per_second.get(s).copied().unwrap_or(0),
                p50_us: summary.as_ref().map(|x| x.p50_us).unwrap_or(0),
                p99_us: summary.as_ref().map(|x| x.p99_us).unwrap_or(0),
                max_us: summary.as_ref().map(|x| x.max_us).unwrap_or(0),
            }
        })
        .collect();
    let report = RunReport {
        command: command.to_string(),
        machine: Machine::read(),
        config: args.clone(),
        node_spec,
        addresses: addresses.clone(),
        applied,
        sent,
        ok: recorder.ok,
        errors: recorder.error_count(),
        errors_by_kind: recorder
            .errors
            .iter()
            .map(|(k, v)| (k.name().to_string(), *v))
            .collect(),
        ok_warmup: recorder.ok_warmup,
        errors_warmup: recorder.errors_warmup,
        measured_s,
        throughput_per_s: if measured_s > 0.0 {
            recorder.ok as f64 / measured_s
        } else {
            0.0
        },
        latency,
        per_second,
        longest_unreachable_ms: recorder
            .longest_unreachable
            .map(|u| u.length_ns as f64 / 1e6)
            .unwrap_or(0.0),
        longest_unreachable_entity: recorder.longest_unreachable.map(|u| u.entity),
        events: marks.iter().map(|m| (m.t_s, m.label.clone())).collect(),
        verify: verdict,
        messages_delivered: delivered,
        entities_activated: activated,
        dead_letters,
        hit_ratio: delivered.zip(activated).and_then(|(d, a)| hit_ratio(d, a)),
        wall_s: 0.0,
    };
    print_summary(&report, &args, elapsed);
    if let Some(path) = &args.hgrm {
        crate::report::write_hgrm(path, &recorder.histogram)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        let series = |f: fn(&SecondFigures) -> u64| -> Vec<(f64, f64)> {
            report
                .per_second
                .iter()
                .filter(|s| s.ok > 0)
                .map(|s| (s.t_s as f64 + 0.5, f(s) as f64 / 1e3))
                .collect()
        };
        let timeline = Timeline {
            p50_ms: series(|s| s.p50_us),
            p99_ms: series(|s| s.p99_us),
            max_ms: series(|s| s.max_us),
            errors: report
                .per_second
                .iter()
                .map(|s| (s.t_s as f64 + 0.5, s.errors))
                .collect(),
            marks: marks.clone(),
        };
        let title = PlotTitle {
            title: format!("shardline-bench {command}: latency"),
            subtitle: match args.scenario {
                Scenario::Steady => report.applied.clone(),
                scenario => format!(
                    "scenario {}; {}",
                    scenario
                        .to_possible_value()
                        .map(|v| v.get_name().to_string())
                        .unwrap_or_default(),
                    report.applied
                ),
            },
        };
        crate::plot::write_plot(path, &title, &recorder.histogram, Some(&timeline))?;
        println!("wrote {}", path.display());
    }
    if let Some(c) = cluster.as_mut() {
        c.stop_all(Duration::from_secs(10));
    }
    let report = RunReport {
        wall_s: wall.elapsed().as_secs_f64(),
        ..report
    };
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if INTERRUPTED.load(Ordering::SeqCst) {
        eprintln!("interrupted: the figures cover the run until Ctrl-C");
    }
    Ok(report)
}

/// How long the harness waits for each spawned node to be ready at start.
const CLUSTER_FORMATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Fresh clusters tried before giving up when one does not form (each
/// failure is printed and its logs kept).
const CLUSTER_START_ATTEMPTS: u32 = 2;

/// How long a scenario waits for a restarted or added node to be ready.
const SCENARIO_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Carries out one scenario step. A failure (a node that does not come back)
/// does not end the run: it is printed and marked, and the load goes on.
fn run_step(
    c: &mut LocalCluster,
    step: &Step,
    connector: &dyn Connector,
    origin: Instant,
    marks: &mut Vec<Mark>,
) {
    let mut mark = |label: String| {
        let t_s = origin.elapsed().as_secs_f64();
        eprintln!("[{t_s:7.2} s] {label}");
        marks.push(Mark { t_s, label });
    };
    let result = match *step {
        Step::Kill(i) => {
            mark(format!("SIGKILL {}", c.nodes[i].name));
            c.kill(i);
            Ok(())
        }
        Step::Terminate(i) => {
            mark(format!("SIGTERM {}", c.nodes[i].name));
            if !c.terminate(i, Duration::from_secs(10)) {
                mark(format!("{} needed SIGKILL", c.nodes[i].name));
            }
            Ok(())
        }
        Step::Start(i) => {
            mark(format!("start {}", c.nodes[i].name));
            c.start(i)
        }
        Step::WaitReady(i) => c
            .wait_ready(i, connector, SCENARIO_READY_TIMEOUT)
            .map(|_| mark(format!("{} ready", c.nodes[i].name))),
    };
    if let Err(error) = result {
        let first = format!("{error:#}");
        let first = first.lines().next().unwrap_or("").to_string();
        eprintln!("scenario step failed: {error:#}");
        c.keep_files();
        mark(format!("step failed: {first}"));
    }
}

fn progress_bar(hidden: bool, total: u64, unit: &str) -> indicatif::ProgressBar {
    if hidden || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    let template = format!("{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit}  {{msg}}");
    bar.set_style(
        indicatif::ProgressStyle::with_template(&template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

fn print_summary(r: &RunReport, args: &RunArgs, elapsed: Duration) {
    println!();
    println!("{}", r.applied);
    println!(
        "requests: {} sent, {} ok, {} errors (warm-up: {} ok, {} errors) in {:.2} s",
        r.sent,
        r.ok,
        r.errors,
        r.ok_warmup,
        r.errors_warmup,
        elapsed.as_secs_f64()
    );
    if !r.errors_by_kind.is_empty() {
        let mut kinds: Vec<_> = r.errors_by_kind.iter().collect();
        kinds.sort();
        let text: Vec<String> = kinds.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("errors by kind: {}", text.join(", "));
    }
    println!(
        "throughput: {:.0} requests/s over {:.2} s measured",
        r.throughput_per_s, r.measured_s
    );
    println!(
        "latency ({} samples, from intended send time): {}",
        r.latency.count,
        r.latency.line()
    );
    if args.scenario != Scenario::Steady {
        println!("per second (by intended send time):");
        println!(
            "{:>6} {:>9} {:>7} {:>12} {:>12} {:>12}",
            "t (s)", "ok", "errors", "p50", "p99", "max"
        );
        for s in &r.per_second {
            println!(
                "{:>6} {:>9} {:>7} {:>12} {:>12} {:>12}",
                s.t_s,
                s.ok,
                s.errors,
                format_latency_us(s.p50_us),
                format_latency_us(s.p99_us),
                format_latency_us(s.max_us)
            );
        }
        for (t, label) in &r.events {
            println!("event at {t:.2} s: {label}");
        }
    }
    if let Some(entity) = r.longest_unreachable_entity {
        println!(
            "longest unreachability: {:.1} ms (entity {entity})",
            r.longest_unreachable_ms
        );
    }
    if let Some(ratio) = r.hit_ratio {
        println!(
            "node counters: {} messages delivered, {} entity activations, {} dead letters; \
             hit ratio (messages that found their entity active) {ratio:.2}%",
            r.messages_delivered.unwrap_or(0),
            r.entities_activated.unwrap_or(0),
            r.dead_letters.unwrap_or(0)
        );
    }
    if let Some(v) = &r.verify {
        println!("{}", v.line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::fake::{FakeConnector, FakeNode};
    use clap::Parser;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: RunArgs,
    }

    fn parse(line: &[&str]) -> RunArgs {
        Wrapper::try_parse_from(std::iter::once("run").chain(line.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn hit_ratio_is_share_of_messages_not_activating() {
        assert_eq!(hit_ratio(0, 0), None);
        assert!((hit_ratio(200, 50).unwrap() - 75.0).abs() < 1e-12);
    }

    #[test]
    fn options_parse() {
        let a = parse(&[
            "--connect",
            "127.0.0.1:1,127.0.0.1:2",
            "--rate",
            "1000",
            "--dist",
            "zipf:0.9",
            "--op",
            "mix:add=1,get=1",
        ]);
        assert_eq!(a.connect.len(), 2);
        assert_eq!(a.dist, KeyDist::Zipf(0.9));
        assert!(
            Wrapper::try_parse_from(["run", "--connect", "127.0.0.1:1", "--spawn", "2"]).is_err()
        );
        assert!(Wrapper::try_parse_from(["run", "--rate", "5", "--concurrency", "2"]).is_err());
        assert!(Wrapper::try_parse_from(["run", "--scenario", "chaos"]).is_err());
    }

    #[test]
    fn run_against_fake_node_verifies_counters_and_reports() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("r.json");
        let hgrm = dir.path().join("r.hgrm");
        let plot = dir.path().join("r.svg");
        let mut a = parse(&[
            "--connect",
            "127.0.0.1:9",
            "--connections",
            "2",
            "--op",
            "counter-add",
            "--verify",
            "--entities",
            "20",
            "--max-requests",
            "2000",
            "--no-progress",
        ]);
        a.json = Some(json.clone());
        a.hgrm = Some(hgrm.clone());
        a.plot = Some(plot.clone());
        let node = Arc::new(FakeNode::default());
        let report = run(a, Arc::new(FakeConnector(node)), "run").unwrap();
        assert_eq!(report.ok, 2000);
        let v = report.verify.unwrap();
        assert_eq!((v.entities, v.lost, v.duplicated), (20, 0, 0));
        // Baseline gets are before the counters snapshot; 2000 adds after it.
        assert_eq!(report.messages_delivered, Some(2000));
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(j["ok"], 2000);
        assert!(j["machine"]["kernel"].is_string());
        assert!(std::fs::read_to_string(&hgrm)
            .unwrap()
            .contains("Total count    =         2000"));
        assert!(std::fs::metadata(&plot).unwrap().len() > 1000);
    }
}
