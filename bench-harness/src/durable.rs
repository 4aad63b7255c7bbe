//! `shardline-bench durable`: durable counter adds per second on one data
//! core, per durability policy and load depth, against the journal's raw
//! baseline (`pwrite` + `fdatasync`) measured in the same run on the same
//! filesystem.
//!
//! ```text
//!  per policy:  spawn node (data_cores = 1, durability = policy),
//!               start every counter (one `get` each, not measured)
//!    per depth D:  raw baseline: D records in flight, pwrite + fdatasync
//!                  (same cadence as the policy, file in the node's data root)
//!                  durable run: closed loop, D counter adds in flight over
//!                  min(D, --connections) native connections
//!  print: adds/s, p50/p99/p99.9 (HdrHistogram), raw rec/s and p99, ratios
//! ```
//!
//! With `--journal postgres --pg-url URL` the node keeps its events in
//! that PostgreSQL database (`[journal] backend = "postgres"`; the policy
//! rows collapse to one, labelled `postgres`: the database always commits)
//! and the raw baseline is the same number of rows in flight inserted by a
//! plain loop of multi-row `INSERT`s from one connection, one commit per
//! batch, into a scratch table of the same shape as the journal's
//! (`shardline_bench_raw`, created and dropped by the run). `--journal
//! local,postgres` measures both in one run.
//!
//! The raw baseline is what the hardware gives a client that waits for its
//! write to be durable: the best a durable counter can do with the same
//! number of requests in flight. Ratios: `adds/s ÷ raw records/s` and
//! `p99 ÷ raw p99`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use shardline_journal::PersistenceId;

use crate::cluster::{node_binary, Durability, LocalCluster, NodeSpec};
use crate::driver::{Driver, DriverConfig, LoopMode};
use crate::journal_bench::raw_closed_loop;
use crate::report::{LatencySummary, Machine};
use crate::transport::Connector;
use crate::units::{format_latency_us, parse_duration};
use crate::workload::{KeyDist, OpMix, Request, RequestSource, Workload, COUNTER_TYPE};

/// Options of `shardline-bench durable`.
#[derive(clap::Args, Clone, Debug, Serialize)]
pub struct DurableArgs {
    /// Durability policies to measure, comma separated: always, interval:MS.
    #[arg(long, value_delimiter = ',', value_parser = Durability::parse, default_value = "interval:1,always")]
    pub policies: Vec<Durability>,
    /// Counter adds in flight (closed loop), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub depths: Vec<usize>,
    /// Most connections per depth; a depth D uses min(D, this) connections
    /// and spreads its D requests over them (pipelined).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Measured time per policy and depth.
    #[arg(long, value_parser = parse_duration, default_value = "6s")]
    pub duration: Duration,
    /// Warm-up before each measured time (entities activate, recover).
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub warmup: Duration,
    /// Length of each raw baseline run.
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    pub raw_duration: Duration,
    /// Counters (entities) the adds go to, uniformly.
    #[arg(long, default_value_t = 1000)]
    pub entities: u64,
    /// A connection with requests waiting and no reply for this long is
    /// declared dead.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub request_timeout: Duration,
    /// Journal backends to measure, comma separated: local, postgres.
    #[arg(long, value_delimiter = ',', default_value = "local")]
    pub journal: Vec<JournalKind>,
    /// The PostgreSQL database for `--journal postgres`
    /// (`postgres://user@host:port/db`); its `shardline_*` tables are
    /// emptied before each run.
    #[arg(long)]
    pub pg_url: Option<String>,
    /// PostgreSQL raw baseline on the same `depth` persistence ids in every
    /// batch (appends at the right edge of the key index: the baseline of
    /// the first measurements) instead of `depth` distinct ids drawn
    /// uniformly from `--entities` per batch, as the counters' rows are.
    #[arg(long)]
    pub raw_fixed_keys: bool,
    /// How the adds are sent: `one-thread` (a thread per connection sends,
    /// waits for a reply and sends the next, as the raw baseline's loop
    /// does) or `driver` (the load driver of `run`: a sender and a reader
    /// thread per connection, one hand-over per reply).
    #[arg(long, value_enum, default_value = "one-thread")]
    pub client: ClientKind,
    /// Rounds per depth: the raw baseline and the durable run alternate
    /// this many times (each round gets 1/rounds of `--duration` and
    /// `--raw-duration`; the first round's durable part also warms up), so
    /// a disk or database whose speed drifts during the run (a shared
    /// machine) moves both figures alike.
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// Write every figure, the configuration and the machine as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// How `shardline-bench durable` sends its adds (`--client`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientKind {
    /// One thread per connection: send, wait for a reply, send the next.
    OneThread,
    /// The load driver: a sender and a reader thread per connection.
    Driver,
}

/// A journal backend of the durable bench.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalKind {
    /// The node's memory-mapped journals, one row per policy.
    Local,
    /// A PostgreSQL database (`--pg-url`), one row per depth.
    Postgres,
}

impl DurableArgs {
    /// Checks the combination of options.
    ///
    /// # Errors
    /// No policy or depth; policy `none` (nothing to compare with a flush);
    /// a depth or connection count of 0; fewer entities than connections;
    /// a zero duration.
    pub fn validate(&self) -> Result<()> {
        if self.policies.is_empty() || self.depths.is_empty() {
            bail!("--policies and --depths need at least one value each");
        }
        if self.policies.contains(&Durability::None) {
            bail!("policy `none` never flushes: there is no durable add to measure (use always or interval:MS)");
        }
        if self.depths.contains(&0) || self.connections == 0 {
            bail!("--depths and --connections must be at least 1");
        }
        let most = self.depths.iter().map(|d| (*d).min(self.connections)).max();
        if most.is_some_and(|c| self.entities < c as u64) {
            bail!("--entities must be at least the number of connections");
        }
        if self.duration.is_zero() || self.raw_duration.is_zero() {
            bail!("--duration and --raw-duration must be above 0");
        }
        if self.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        if self.journal.is_empty() {
            bail!("--journal needs at least one of local, postgres");
        }
        if self.journal.contains(&JournalKind::Postgres) && self.pg_url.is_none() {
            bail!("--journal postgres needs --pg-url postgres://user@host:port/db");
        }
        Ok(())
    }
}

/// One policy × depth result.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DurableRow {
    /// `always` or `interval:MS`.
    pub policy: String,
    /// Requests in flight (count).
    pub depth: usize,
    /// Connections carrying them (count).
    pub connections: usize,
    /// Acknowledged adds per second of measured time.
    pub adds_per_s: f64,
    /// Failed adds after warm-up (count).
    pub errors: u64,
    /// Add latency, send to acknowledgement (µs).
    pub latency: LatencySummary,
    /// Raw baseline: records per second, same depth and policy.
    pub raw_records_per_s: f64,
    /// Raw baseline: write-to-durable latency (µs).
    pub raw_latency: LatencySummary,
    /// `adds_per_s / raw_records_per_s`.
    pub throughput_ratio: f64,
    /// `latency.p99_us / raw_latency.p99_us`.
    pub p99_ratio: f64,
}

/// Everything `--json` writes.
#[derive(Serialize)]
struct DurableReport {
    machine: Machine,
    config: DurableArgs,
    rows: Vec<DurableRow>,
    wall_s: f64,
}

/// `always` or `interval:MS`, as `--policies` spells it.
pub fn policy_label(d: &Durability) -> String {
    match d {
        Durability::None => "none".into(),
        Durability::Always => "always".into(),
        Durability::IntervalMs(ms) => format!("interval:{ms}"),
    }
}

/// Ratio of two figures; 0 when the denominator is 0.
fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

impl DurableRow {
    /// Assembles a row and its ratios.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        policy: String,
        depth: usize,
        connections: usize,
        adds_per_s: f64,
        errors: u64,
        latency: LatencySummary,
        raw_records_per_s: f64,
        raw_latency: LatencySummary,
    ) -> DurableRow {
        DurableRow {
            throughput_ratio: ratio(adds_per_s, raw_records_per_s),
            p99_ratio: ratio(latency.p99_us as f64, raw_latency.p99_us as f64),
            policy,
            depth,
            connections,
            adds_per_s,
            errors,
            latency,
            raw_records_per_s,
            raw_latency,
        }
    }
}

/// The results as a table, one line per policy and depth.
pub fn format_report(rows: &[DurableRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:>5} {:>10} {:>10} {:>10} {:>10} | {:>10} {:>10} | {:>7} {:>7} {:>6}",
        "policy",
        "depth",
        "adds/s",
        "p50",
        "p99",
        "p99.9",
        "raw rec/s",
        "raw p99",
        "x tput",
        "x p99",
        "errors"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<12} {:>5} {:>10.0} {:>10} {:>10} {:>10} | {:>10.0} {:>10} | {:>6.2}x {:>6.2}x {:>6}",
            r.policy,
            r.depth,
            r.adds_per_s,
            format_latency_us(r.latency.p50_us),
            format_latency_us(r.latency.p99_us),
            format_latency_us(r.latency.p99_9_us),
            r.raw_records_per_s,
            format_latency_us(r.raw_latency.p99_us),
            r.throughput_ratio,
            r.p99_ratio,
            r.errors
        );
    }
    out
}

const FORMATION_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the benchmark; prints the table and returns its rows.
///
/// # Errors
/// Invalid options, a node that does not start, a raw baseline I/O error,
/// a load that fails, or a JSON file that cannot be written.
pub fn run(args: &DurableArgs, connector: Arc<dyn Connector>) -> Result<Vec<DurableRow>> {
    args.validate()?;
    let wall = Instant::now();
    let binary = node_binary()?;
    let pid = PersistenceId::new(&format!("{COUNTER_TYPE}|{}", args.entities - 1))
        .context("persistence id of the raw baseline")?;
    // A counter add event: one i64 delta.
    let payload = 1i64.to_le_bytes();
    let mut rows = Vec::new();
    for journal in &args.journal {
        let runs: Vec<(Durability, String, String)> = match journal {
            JournalKind::Local => args
                .policies
                .iter()
                .map(|p| (p.clone(), policy_label(p), String::new()))
                .collect(),
            JournalKind::Postgres => {
                let url = args.pg_url.clone().unwrap_or_default();
                vec![(
                    Durability::Always,
                    "postgres".to_string(),
                    format!(
                        "[journal]\nbackend = \"postgres\"\nurl = \"{}\"\n",
                        url.replace('\\', "\\\\").replace('"', "\\\"")
                    ),
                )]
            }
        };
        for (policy, label, extra_toml) in runs {
            if *journal == JournalKind::Postgres {
                reset_pg(args.pg_url.as_deref().unwrap_or_default())?;
            }
            let spec = NodeSpec {
                data_cores: 1,
                pin_cores: false,
                number_of_shards: 100,
                durability: policy.clone(),
                idle_timeout_ms: 0,
                active_entity_limit: 0,
                extra_toml,
            };
            let mut cluster = LocalCluster::prepare(binary.clone(), 1, 0, &spec)?;
            eprintln!(
                "durable bench: {label} on one node, 1 data core, in {} ...",
                cluster.dir().display()
            );
            if let Err(e) = cluster.start_initial(connector.as_ref(), FORMATION_TIMEOUT) {
                cluster.keep_files();
                return Err(e.context("the bench node did not start"));
            }
            let addrs = cluster.client_addresses();
            let interval = match policy {
                Durability::IntervalMs(ms) => Some(Duration::from_millis(ms)),
                _ => None,
            };
            activate_all(args, &connector, &addrs)
                .with_context(|| format!("activating the counters, {label}"))?;
            for &depth in &args.depths {
                let rounds = args.rounds.max(1);
                let mut raw_rows = 0.0f64;
                let mut raw_secs = 0.0f64;
                let mut raw_us = crate::stats::latency_histogram(3);
                let mut ok = 0u64;
                let mut secs = 0.0f64;
                let mut errors = 0u64;
                let mut hist = crate::stats::latency_histogram(3);
                let mut conns = 0;
                for round in 0..rounds {
                    let raw_duration = args.raw_duration / rounds;
                    // Raw baseline first, while the node is idle.
                    let (per_s, h) = match journal {
                        JournalKind::Local => {
                            let raw = raw_closed_loop(
                                cluster.dir(),
                                interval,
                                depth as u64,
                                &pid,
                                &payload,
                                raw_duration,
                            )?;
                            (raw.records_per_s(), ns_to_us(&raw.latency_ns))
                        }
                        JournalKind::Postgres => raw_pg_loop(
                            args.pg_url.as_deref().unwrap_or_default(),
                            depth,
                            (!args.raw_fixed_keys).then_some(args.entities),
                            &payload,
                            raw_duration,
                        )?,
                    };
                    raw_rows += per_s * raw_duration.as_secs_f64();
                    raw_secs += raw_duration.as_secs_f64();
                    let _ = raw_us.add(&h);
                    let warmup = if round == 0 {
                        args.warmup
                    } else {
                        args.warmup.min(Duration::from_millis(200))
                    };
                    let run = match args.client {
                        ClientKind::OneThread => drive,
                        ClientKind::Driver => drive_threads,
                    };
                    let d = run(
                        args,
                        &connector,
                        &addrs,
                        depth,
                        warmup,
                        args.duration / rounds,
                    )
                    .with_context(|| format!("durable adds, {label} depth {depth}"))?;
                    ok += d.ok;
                    secs += d.measured_s;
                    errors += d.errors;
                    let _ = hist.add(&d.histogram);
                    conns = d.connections;
                }
                let raw_per_s = ratio(raw_rows, raw_secs);
                let adds_per_s = ratio(ok as f64, secs);
                let latency = LatencySummary::of(&hist);
                let row = DurableRow::new(
                    label.clone(),
                    depth,
                    conns,
                    adds_per_s,
                    errors,
                    latency,
                    raw_per_s,
                    LatencySummary::of(&raw_us),
                );
                eprint!("{}", format_report(std::slice::from_ref(&row)));
                rows.push(row);
            }
            cluster.stop_all(Duration::from_secs(5));
        }
    }
    print!("{}", format_report(&rows));
    if let Some(path) = &args.json {
        let report = DurableReport {
            machine: Machine::read(),
            config: args.clone(),
            rows: rows.clone(),
            wall_s: wall.elapsed().as_secs_f64(),
        };
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(rows)
}

/// Empties the journal's tables of the database at `url` (a run starts
/// from an empty journal).
fn reset_pg(url: &str) -> Result<()> {
    let mut c = postgres::Client::connect(url, postgres::NoTls)
        .with_context(|| format!("connecting to {url}"))?;
    c.batch_execute(
        "DO $$ BEGIN
           IF to_regclass('shardline_events') IS NOT NULL THEN
             TRUNCATE shardline_events, shardline_snapshots, shardline_writers;
           END IF;
         END $$;",
    )
    .context("emptying the journal tables")?;
    Ok(())
}

/// The PostgreSQL raw baseline: `depth` rows in flight as one multi-row
/// `INSERT` (one statement, one commit) after another from one
/// connection, into a scratch table shaped like `shardline_events`, for
/// `duration`. With `spread = Some(n)` each batch's rows go to `depth`
/// distinct ids drawn uniformly from `n` (each id's sequence numbers
/// 1, 2, ...), as the bench's counter adds do; with `None` every batch
/// uses the same `depth` ids. Returns rows per second and the per-row
/// latency (µs: a row's batch from send to commit).
fn raw_pg_loop(
    url: &str,
    depth: usize,
    spread: Option<u64>,
    payload: &[u8],
    duration: Duration,
) -> Result<(f64, hdrhistogram::Histogram<u64>)> {
    use rand::SeedableRng;
    let mut c = postgres::Client::connect(url, postgres::NoTls)
        .with_context(|| format!("connecting to {url}"))?;
    c.batch_execute(
        "DROP TABLE IF EXISTS shardline_bench_raw;
         CREATE TABLE shardline_bench_raw (persistence_id text NOT NULL,
           sequence_nr bigint NOT NULL, writer_epoch bigint NOT NULL,
           payload bytea NOT NULL, claim boolean NOT NULL DEFAULT false,
           PRIMARY KEY (persistence_id, sequence_nr))",
    )
    .context("creating the raw baseline's table")?;
    let st = c
        .prepare(
            "INSERT INTO shardline_bench_raw SELECT * FROM \
             unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])",
        )
        .context("preparing the raw insert")?;
    let mut hist = crate::stats::latency_histogram(3);
    let ids = spread.unwrap_or(depth as u64).max(depth as u64) as usize;
    let all: Vec<String> = (0..ids).map(|i| format!("{COUNTER_TYPE}|{i}")).collect();
    let mut next_seq = vec![1i64; ids];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5241_5750);
    let epochs = vec![1i64; depth];
    let payloads: Vec<&[u8]> = vec![payload; depth];
    let mut rows = 0u64;
    let start = Instant::now();
    while start.elapsed() < duration {
        let picked: Vec<usize> = if spread.is_some() {
            rand::seq::index::sample(&mut rng, ids, depth).into_vec()
        } else {
            (0..depth).collect()
        };
        let pids: Vec<&str> = picked.iter().map(|&i| all[i].as_str()).collect();
        let seqs: Vec<i64> = picked
            .iter()
            .map(|&i| {
                next_seq[i] += 1;
                next_seq[i] - 1
            })
            .collect();
        let t = Instant::now();
        c.execute(&st, &[&pids, &seqs, &epochs, &payloads])
            .context("raw insert")?;
        let us = (t.elapsed().as_micros() as u64).max(1);
        let _ = hist.record_n(us, depth as u64);
        rows += depth as u64;
    }
    let elapsed = start.elapsed();
    c.batch_execute("DROP TABLE IF EXISTS shardline_bench_raw")
        .context("dropping the raw baseline's table")?;
    Ok((rows as f64 / elapsed.as_secs_f64().max(1e-9), hist))
}

/// A histogram in ns as one in µs (values rounded down, at least 1).
fn ns_to_us(h: &hdrhistogram::Histogram<u64>) -> hdrhistogram::Histogram<u64> {
    let mut out = crate::stats::latency_histogram(3);
    for v in h.iter_recorded() {
        let _ = out.record_n((v.value_iterated_to() / 1000).max(1), v.count_at_value());
    }
    out
}

/// What one closed-loop run of counter adds measured.
struct Driven {
    /// Acknowledged adds after the warm-up (count).
    ok: u64,
    /// Measured time (s).
    measured_s: f64,
    /// Failed adds after the warm-up (count).
    errors: u64,
    /// Add latency (µs).
    histogram: hdrhistogram::Histogram<u64>,
    /// Connections used (count).
    connections: usize,
}

/// Starts (recovers) every counter before the first measured depth: one
/// `get` of each of the `--entities` counters, 64 in flight over up to
/// `--connections` connections, not measured. Without it the first depth
/// measures entity recoveries beside the adds (with 1,000 counters at depth
/// 1, about half of the adds were a counter's first, and on PostgreSQL each
/// first add also waits for the recovery's claim, a commit of its own),
/// which the raw baseline does not do.
///
/// # Errors
/// A connection that fails or a `get` that is not answered `Ok`.
fn activate_all(
    args: &DurableArgs,
    connector: &Arc<dyn Connector>,
    addrs: &[std::net::SocketAddr],
) -> Result<()> {
    let depth = 64usize;
    let conns = depth.min(args.connections).max(1);
    let n = conns as u64;
    let mut sources: Vec<Box<dyn Iterator<Item = Result<Request>> + Send>> = Vec::new();
    for c in 0..n {
        sources.push(Box::new((c..args.entities).step_by(conns).map(|entity| {
            Ok(Request {
                entity,
                op: crate::workload::OpKind::CounterGet,
            })
        })));
    }
    let out = closed_loop(args, connector, addrs, depth, sources, Duration::ZERO, None)?;
    let errors = out.recorder.error_count();
    if errors > 0 || out.recorder.ok < args.entities {
        bail!(
            "{} of {} counters answered their first get ({errors} errors)",
            out.recorder.ok,
            args.entities
        );
    }
    Ok(())
}

/// Runs `sources` (one per connection) closed loop over
/// `depth.min(args.connections)` connections with `depth` requests in
/// flight in all (split as evenly as possible), `warmup` then `duration`
/// (`None`: until the sources end), and waits for the driver.
///
/// # Errors
/// The driver's (a connection that fails).
fn closed_loop(
    args: &DurableArgs,
    connector: &Arc<dyn Connector>,
    addrs: &[std::net::SocketAddr],
    depth: usize,
    sources: Vec<Box<dyn Iterator<Item = Result<Request>> + Send>>,
    warmup: Duration,
    duration: Option<Duration>,
) -> Result<crate::driver::Outcome> {
    let conns = sources.len();
    let windows = (0..conns)
        .map(|c| depth / conns + usize::from(c < depth % conns))
        .collect();
    let config = DriverConfig {
        addresses: addrs.to_vec(),
        mode: LoopMode::Closed,
        rates_per_s: vec![0.0; conns],
        windows,
        quotas: vec![u64::MAX; conns],
        warmup,
        duration,
        request_timeout: args.request_timeout,
        capture_values: false,
    };
    Driver::start(
        config,
        connector.clone(),
        sources,
        Instant::now(),
        Arc::new(AtomicBool::new(false)),
    )
    .join()
}

/// The adds both clients send: `counter add 1` to counters drawn
/// uniformly from `--entities`.
fn adds(args: &DurableArgs) -> Result<(Workload, OpMix)> {
    let workload = Workload::Synthetic {
        entities: args.entities,
        dist: KeyDist::Uniform,
    };
    let op = OpMix::parse("counter-add").map_err(anyhow::Error::msg)?;
    Ok((workload, op))
}

/// One closed-loop run of counter adds, `warmup` then `duration` measured,
/// with one thread per connection that sends, waits for a reply and sends
/// the next add itself (`depth` adds in flight in all, split evenly over
/// `depth.min(--connections)` connections). The raw baseline is one thread
/// talking to the database; the load driver's reader and sender threads
/// (a hand-over per reply, 30-70 us of wake-up on a VM) would charge the
/// node a hop the baseline does not pay.
///
/// # Errors
/// A connection that cannot be made, breaks, or stays silent for
/// `--request-timeout`.
fn drive(
    args: &DurableArgs,
    connector: &Arc<dyn Connector>,
    addrs: &[std::net::SocketAddr],
    depth: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<Driven> {
    let conns = depth.min(args.connections).max(1);
    let n = conns as u64;
    let (workload, op) = adds(args)?;
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut threads = Vec::new();
    for c in 0..conns {
        let window = depth / conns + usize::from(c < depth % conns);
        let mut source = RequestSource::new(&workload, &op, 1, c as u64, n)?;
        let (mut sink, mut replies) = connector.connect(addrs[c % addrs.len()])?;
        let timeout = args.request_timeout;
        threads.push(std::thread::spawn(move || -> Result<Driven> {
            let mut hist = crate::stats::latency_histogram(3);
            let (mut ok, mut errors) = (0u64, 0u64);
            let mut sent_at: std::collections::HashMap<u64, Instant> =
                std::collections::HashMap::with_capacity(window);
            let mut next_id = 0u64;
            let mut send_one = |sink: &mut Box<dyn crate::transport::RequestSink>,
                                sent_at: &mut std::collections::HashMap<u64, Instant>|
             -> Result<()> {
                let r = source.next().context("the add source ended")??;
                next_id += 1;
                sent_at.insert(next_id, Instant::now());
                sink.send(
                    next_id,
                    r.op.type_name(),
                    &r.entity.to_string(),
                    r.op.payload(),
                )
            };
            for _ in 0..window {
                send_one(&mut sink, &mut sent_at)?;
            }
            sink.flush()?;
            let mut last_done = start;
            while !sent_at.is_empty() {
                let reply = replies.recv()?;
                let now = Instant::now();
                let Some(t) = sent_at.remove(&reply.request_id) else {
                    continue;
                };
                if now.duration_since(t) > timeout {
                    bail!("an add took longer than {timeout:?}");
                }
                if t >= measure_from && now <= end {
                    let good = reply.error.is_none()
                        && crate::verify::parse_counter_value(&reply.payload).is_some();
                    if good {
                        ok += 1;
                        let us = (now.duration_since(t).as_micros() as u64).max(1);
                        let _ = hist.record(us);
                    } else {
                        errors += 1;
                    }
                    last_done = now;
                }
                if now < end {
                    send_one(&mut sink, &mut sent_at)?;
                    sink.flush()?;
                }
            }
            Ok(Driven {
                ok,
                measured_s: last_done
                    .saturating_duration_since(measure_from)
                    .as_secs_f64(),
                errors,
                histogram: hist,
                connections: 1,
            })
        }));
    }
    let mut total = Driven {
        ok: 0,
        measured_s: 0.0,
        errors: 0,
        histogram: crate::stats::latency_histogram(3),
        connections: conns,
    };
    for t in threads {
        let d = t
            .join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
        total.ok += d.ok;
        total.errors += d.errors;
        total.measured_s = total.measured_s.max(d.measured_s);
        let _ = total.histogram.add(&d.histogram);
    }
    Ok(total)
}

/// One closed-loop run of counter adds through the load driver: `warmup`,
/// then `duration` measured (`--client driver`).
fn drive_threads(
    args: &DurableArgs,
    connector: &Arc<dyn Connector>,
    addrs: &[std::net::SocketAddr],
    depth: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<Driven> {
    let conns = depth.min(args.connections).max(1);
    let n = conns as u64;
    let (workload, op) = adds(args)?;
    let mut sources: Vec<Box<dyn Iterator<Item = Result<Request>> + Send>> = Vec::new();
    for c in 0..n {
        sources.push(Box::new(RequestSource::new(&workload, &op, 1, c, n)?));
    }
    let out = closed_loop(
        args,
        connector,
        addrs,
        depth,
        sources,
        warmup,
        Some(duration),
    )?;
    let warmup_ns = warmup.as_nanos() as u64;
    let measured_s = out.recorder.last_completion_ns.saturating_sub(warmup_ns) as f64 / 1e9;
    Ok(Driven {
        ok: out.recorder.ok,
        measured_s,
        errors: out.recorder.error_count(),
        histogram: out.recorder.histogram,
        connections: conns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DurableArgs,
    }

    fn parse(argv: &[&str]) -> Result<DurableArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("durable").chain(argv.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn defaults_measure_interval_and_always_at_depths_1_and_16() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            a.policies,
            vec![Durability::IntervalMs(1), Durability::Always]
        );
        assert_eq!(a.depths, vec![1, 16]);
        assert_eq!(a.duration, Duration::from_secs(6));
        assert_eq!(a.warmup, Duration::from_secs(1));
        assert_eq!(a.raw_duration, Duration::from_secs(2));
        assert_eq!(a.rounds, 1);
        assert!(!a.raw_fixed_keys);
        assert_eq!(a.client, ClientKind::OneThread);
        assert_eq!(
            parse(&["--client", "driver"]).unwrap().client,
            ClientKind::Driver
        );
        a.validate().unwrap();
        // Bounded: about a minute with the defaults (cluster starts aside).
        let runs = (a.policies.len() * a.depths.len()) as u32;
        assert!((a.duration + a.warmup + a.raw_duration) * runs <= Duration::from_secs(60));
    }

    #[test]
    fn options_parse() {
        let a = parse(&[
            "--policies",
            "interval:5",
            "--depths",
            "2,8,32",
            "--connections",
            "2",
            "--duration",
            "500ms",
            "--entities",
            "10",
            "--rounds",
            "3",
            "--raw-fixed-keys",
        ])
        .unwrap();
        assert_eq!(a.rounds, 3);
        assert!(a.raw_fixed_keys);
        assert_eq!(a.policies, vec![Durability::IntervalMs(5)]);
        assert_eq!(a.depths, vec![2, 8, 32]);
        assert_eq!(a.connections, 2);
        assert_eq!(a.duration, Duration::from_millis(500));
        a.validate().unwrap();
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(parse(&["--policies", "sometimes"]).is_err());
        assert!(parse(&["--depths", "x"]).is_err());
        assert!(parse(&["--policies", "none"]).unwrap().validate().is_err());
        assert!(parse(&["--depths", "0"]).unwrap().validate().is_err());
        assert!(parse(&["--connections", "0"]).unwrap().validate().is_err());
        assert!(parse(&["--entities", "2", "--depths", "16"])
            .unwrap()
            .validate()
            .is_err());
        assert!(parse(&["--duration", "0s"]).unwrap().validate().is_err());
        assert!(parse(&["--rounds", "0"]).unwrap().validate().is_err());
        assert!(parse(&["--journal", "postgres"])
            .unwrap()
            .validate()
            .is_err());
        assert!(parse(&["--journal", "sqlite"]).is_err());
        let a = parse(&[
            "--journal",
            "local,postgres",
            "--pg-url",
            "postgres://u@h/db",
        ])
        .unwrap();
        assert_eq!(a.journal, vec![JournalKind::Local, JournalKind::Postgres]);
        a.validate().unwrap();
    }

    fn summary(p50: u64, p99: u64, p999: u64) -> LatencySummary {
        LatencySummary {
            count: 10,
            min_us: 1,
            p50_us: p50,
            p90_us: p99,
            p99_us: p99,
            p99_9_us: p999,
            p99_99_us: p999,
            max_us: p999,
        }
    }

    #[test]
    fn rows_carry_ratios_against_the_raw_baseline() {
        let r = DurableRow::new(
            "always".into(),
            16,
            4,
            5000.0,
            0,
            summary(2_000, 4_000, 9_000),
            10_000.0,
            summary(500, 1_000, 2_000),
        );
        assert!((r.throughput_ratio - 0.5).abs() < 1e-9);
        assert!((r.p99_ratio - 4.0).abs() < 1e-9);
        let zero = DurableRow::new(
            "always".into(),
            1,
            1,
            10.0,
            0,
            summary(1, 1, 1),
            0.0,
            LatencySummary::of(&crate::stats::latency_histogram(3)),
        );
        assert_eq!(zero.throughput_ratio, 0.0);
        assert_eq!(zero.p99_ratio, 0.0);
    }

    #[test]
    fn report_has_a_header_and_one_line_per_row() {
        let rows = vec![
            DurableRow::new(
                "interval:1".into(),
                1,
                1,
                812.4,
                0,
                summary(1_150, 1_900, 2_300),
                960.0,
                summary(1_000, 1_100, 1_200),
            ),
            DurableRow::new(
                "always".into(),
                16,
                4,
                5000.0,
                3,
                summary(2_000, 4_000, 9_000),
                10_000.0,
                summary(500, 1_000, 2_000),
            ),
        ];
        let text = format_report(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("policy"), "{text}");
        for h in [
            "adds/s",
            "p50",
            "p99",
            "p99.9",
            "raw rec/s",
            "raw p99",
            "x tput",
        ] {
            assert!(lines[0].contains(h), "{h} missing: {text}");
        }
        assert!(lines[1].starts_with("interval:1"), "{text}");
        assert!(lines[1].contains(" 812 "), "{text}");
        assert!(lines[1].contains("1.150 ms"), "{text}");
        assert!(lines[1].contains("0.85x"), "{text}");
        assert!(lines[2].starts_with("always"), "{text}");
        assert!(lines[2].contains("0.50x"), "{text}");
        assert!(lines[2].contains("4.00x"), "{text}");
        assert!(lines[2].trim_end().ends_with('3'), "{text}");
    }
}
