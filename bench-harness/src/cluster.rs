//! A local cluster of node child processes (`--spawn N`): this executable
//! run as `shardline-bench node --config FILE` (the `shardline node`
//! command line), or `$SHARDLINE_BIN node --config FILE`.
//!
//! Configs are generated into a temporary directory with loopback ports
//! that were free when allocated; every node lists the initial nodes as seed
//! nodes. A node counts as ready when it printed `shardline: ready` and then
//! answered an echo request. Children are stopped with SIGTERM, then
//! SIGKILL after a bound, at the end of the run and when the cluster is
//! dropped (also on panic); on Linux they also get SIGKILL if the harness
//! dies (`PR_SET_PDEATHSIG`), so a killed harness leaves no node behind.
//! Nodes must be started from the main thread (the death signal follows the
//! thread that spawned the child).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::transport::Connector;
use crate::workload::{COUNTER_TYPE, ECHO_TYPE};

/// Durability of persistent entities, as the node config's `durability`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Durability {
    /// No journal (`"none"`).
    None,
    /// Fsync before acknowledging (`"always"`).
    Always,
    /// Group commit every N ms (`{ interval_ms = N }`).
    IntervalMs(u64),
}

impl Durability {
    /// Parses `none`, `always` or `interval:MS`.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(text: &str) -> Result<Durability, String> {
        match text {
            "none" => Ok(Durability::None),
            "always" => Ok(Durability::Always),
            _ => match text.strip_prefix("interval:").map(str::parse::<u64>) {
                Some(Ok(ms)) if ms > 0 => Ok(Durability::IntervalMs(ms)),
                _ => Err(format!(
                    "unknown durability `{text}` (use none, always or interval:MS)"
                )),
            },
        }
    }

    fn toml(&self) -> String {
        match self {
            Durability::None => "\"none\"".into(),
            Durability::Always => "\"always\"".into(),
            Durability::IntervalMs(ms) => format!("{{ interval_ms = {ms} }}"),
        }
    }
}

/// What every spawned node is configured with.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeSpec {
    /// Data executors (regions) per node (count).
    pub data_cores: u16,
    /// Pin executors to cores.
    pub pin_cores: bool,
    /// Shards of each entity type (count).
    pub number_of_shards: u32,
    /// Journal durability.
    pub durability: Durability,
    /// Idle passivation timeout (ms, 0 disables).
    pub idle_timeout_ms: u64,
    /// Active entities per region before LRU passivation (count, 0 = no limit).
    pub active_entity_limit: u64,
    /// Extra TOML tables appended to each node's config (e.g. a
    /// `[journal]` table); empty for none.
    pub extra_toml: String,
}

fn toml_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The TOML config of one node (format in `docs/interfaces.md`: node config).
pub fn node_config(
    spec: &NodeSpec,
    cluster: SocketAddr,
    client: SocketAddr,
    seeds: &[SocketAddr],
    data_dir: &Path,
) -> String {
    let seeds: Vec<String> = seeds.iter().map(|s| toml_string(&s.to_string())).collect();
    let mut text = format!(
        "cluster_address = {}\nclient_address = {}\nseed_nodes = [{}]\ndata_cores = {}\npin_cores = {}\n\
         data_dir = {}\nnumber_of_shards = {}\ndurability = {}\n",
        toml_string(&cluster.to_string()),
        toml_string(&client.to_string()),
        seeds.join(", "),
        spec.data_cores,
        spec.pin_cores,
        toml_string(&data_dir.to_string_lossy()),
        spec.number_of_shards,
        spec.durability.toml(),
    );
    for (name, kind) in [(COUNTER_TYPE, "counter"), (ECHO_TYPE, "echo")] {
        text.push_str(&format!(
            "\n[[entity_types]]\nname = {}\nkind = {}\nidle_timeout_ms = {}\nactive_entity_limit = {}\n",
            toml_string(name),
            toml_string(kind),
            spec.idle_timeout_ms,
            spec.active_entity_limit
        ));
    }
    if !spec.extra_toml.is_empty() {
        text.push('\n');
        text.push_str(&spec.extra_toml);
        text.push('\n');
    }
    // A/B runs of one build with another node setting (e.g.
    // `[coordinator]` `warm_allocation = false`): TOML appended to every
    // spawned node's config.
    if let Ok(extra) = std::env::var(NODE_TOML_ENV) {
        if !extra.is_empty() {
            text.push('\n');
            text.push_str(&extra);
            text.push('\n');
        }
    }
    text
}

/// The environment variable whose value (TOML) is appended to the config
/// of every node the harness spawns (demo and `run --spawn`), for A/B
/// runs of one build with another node setting.
pub const NODE_TOML_ENV: &str = "SHARDLINE_BENCH_NODE_TOML";

/// `count` distinct loopback addresses whose ports were free a moment ago.
///
/// # Errors
/// When no port can be bound.
pub fn free_addresses(count: usize) -> Result<Vec<SocketAddr>> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").context("cannot bind a loopback port"))
        .collect::<Result<_>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().context("local address"))
        .collect()
}

/// The first argument that makes `shardline-bench` run as a node
/// (`shardline-bench node --config FILE`, the `shardline node` command).
pub const NODE_SUBCOMMAND: &str = "node";

/// The program that runs the local cluster's nodes as `PROGRAM node
/// --config FILE`: `$SHARDLINE_BIN` when set (a `shardline` binary), else
/// this executable, which runs the `shardline` command line when its first
/// argument is `node` (see `main.rs`), so no other binary is built.
///
/// # Errors
/// When `$SHARDLINE_BIN` is unset and the running executable cannot be
/// located.
pub fn node_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SHARDLINE_BIN") {
        return Ok(PathBuf::from(path));
    }
    std::env::current_exe().context("cannot locate the running executable to start nodes with")
}

/// One node of the local cluster.
pub struct LocalNode {
    /// `node-1`, `node-2`, ...
    pub name: String,
    /// Node-to-node address.
    pub cluster_address: SocketAddr,
    /// Native-protocol address.
    pub client_address: SocketAddr,
    /// Its config file.
    pub config_path: PathBuf,
    /// stdout and stderr of every incarnation, appended.
    pub log_path: PathBuf,
    child: Option<Child>,
    ready: Option<mpsc::Receiver<()>>,
}

/// A local cluster of node processes.
pub struct LocalCluster {
    binary: PathBuf,
    /// Nodes: the initial ones first, then the spares (started on demand).
    pub nodes: Vec<LocalNode>,
    initial: usize,
    dir: tempfile::TempDir,
    keep: bool,
}

impl LocalCluster {
    /// Writes the configs of `initial + spare` nodes (the spares join later,
    /// e.g. in the rebalance scenario) without starting any.
    ///
    /// # Errors
    /// When the temporary directory, a port or a config file cannot be had.
    pub fn prepare(
        binary: PathBuf,
        initial: usize,
        spare: usize,
        spec: &NodeSpec,
    ) -> Result<LocalCluster> {
        let dir = tempfile::Builder::new()
            .prefix("shardline-bench-")
            .tempdir()
            .context("temporary directory")?;
        let total = initial + spare;
        let addrs = free_addresses(2 * total)?;
        let (cluster, client) = addrs.split_at(total);
        let seeds = &cluster[..initial];
        let mut nodes = Vec::new();
        for i in 0..total {
            let name = format!("node-{}", i + 1);
            let data_dir = dir.path().join(&name);
            std::fs::create_dir_all(&data_dir)?;
            let config_path = dir.path().join(format!("{name}.toml"));
            std::fs::write(
                &config_path,
                node_config(spec, cluster[i], client[i], seeds, &data_dir),
            )?;
            nodes.push(LocalNode {
                log_path: dir.path().join(format!("{name}.log")),
                name,
                cluster_address: cluster[i],
                client_address: client[i],
                config_path,
                child: None,
                ready: None,
            });
        }
        Ok(LocalCluster {
            binary,
            nodes,
            initial,
            dir,
            keep: false,
        })
    }

    /// The temporary directory holding configs, data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Keeps the temporary directory (configs, data, logs) after the cluster
    /// is dropped, e.g. to read the logs of a node that failed.
    pub fn keep_files(&mut self) {
        self.keep = true;
    }

    /// Client addresses of the initial nodes.
    pub fn client_addresses(&self) -> Vec<SocketAddr> {
        self.nodes[..self.initial]
            .iter()
            .map(|n| n.client_address)
            .collect()
    }

    /// Starts node `i` (must not be running). Call from the main thread.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub fn start(&mut self, i: usize) -> Result<()> {
        let node = &mut self.nodes[i];
        if node.child.is_some() {
            bail!("{} is already running", node.name);
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log_path)?;
        let mut command = Command::new(&self.binary);
        command
            .arg(NODE_SUBCOMMAND)
            .arg("--config")
            .arg(&node.config_path)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log.try_clone()?));
        // SAFETY: prctl is async-signal-safe and touches no memory of the
        // parent; it only asks the kernel to SIGKILL this child when the
        // spawning thread exits.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {} ({})", node.name, self.binary.display()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || forward_stdout(stdout, log, tx));
        node.child = Some(child);
        node.ready = Some(rx);
        Ok(())
    }

    /// Waits until node `i` printed its ready line and answered an echo
    /// request; returns how long that took.
    ///
    /// # Errors
    /// When the node exits or is not ready within `timeout`; the message
    /// holds the end of its log.
    pub fn wait_ready(
        &mut self,
        i: usize,
        connector: &dyn Connector,
        timeout: Duration,
    ) -> Result<Duration> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut saw_line = false;
        loop {
            let node = &mut self.nodes[i];
            if let Some(child) = node.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    node.child = None;
                    bail!(
                        "{} exited ({status}) before it was ready:\n{}",
                        node.name,
                        log_tail(&node.log_path)
                    );
                }
            } else {
                bail!("{} is not running", node.name);
            }
            if !saw_line {
                if let Some(rx) = node.ready.as_ref() {
                    saw_line = rx.recv_timeout(Duration::from_millis(100)).is_ok();
                }
            } else {
                let probe = connector.ask(
                    node.client_address,
                    ECHO_TYPE,
                    &format!("ready-probe-{}", i + 1),
                    b"ping",
                    Duration::from_secs(2),
                );
                if matches!(probe, Ok(ref reply) if reply.error.is_none()) {
                    return Ok(started.elapsed());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if Instant::now() > deadline {
                let what = if saw_line {
                    "did not answer a request"
                } else {
                    "did not print `shardline: ready`"
                };
                bail!(
                    "{} {what} within {:?}; log {}:\n{}",
                    node.name,
                    timeout,
                    node.log_path.display(),
                    log_tail(&node.log_path)
                );
            }
        }
    }

    /// Starts the initial nodes and waits until all are ready: the first
    /// seed node alone first (it forms the cluster, as Akka's first seed
    /// node does), then the others together (they join through the seeds).
    ///
    /// # Errors
    /// As [`LocalCluster::start`] and [`LocalCluster::wait_ready`].
    pub fn start_initial(&mut self, connector: &dyn Connector, timeout: Duration) -> Result<()> {
        self.start(0)?;
        self.wait_ready(0, connector, timeout)?;
        for i in 1..self.initial {
            self.start(i)?;
        }
        for i in 1..self.initial {
            self.wait_ready(i, connector, timeout)?;
        }
        Ok(())
    }

    /// Waits until the shards of every entity type are spread over the
    /// running initial nodes' regions as the coordinator's allocation
    /// strategy leaves them: the hosting regions differ by at most one shard
    /// (the default strategy's rebalance threshold), every shard the
    /// coordinator allocated is hosted (none is handing off), and the
    /// layout did not change between two polls [`BALANCE_POLL`] apart.
    /// Returns how long that took.
    ///
    /// [`LocalCluster::start_initial`] starts the first seed alone, so with
    /// warm allocation it gets every shard and the joiners get theirs by
    /// rebalance hand-offs; waiting here keeps those hand-offs out of the
    /// measured load. With on-demand allocation (nothing allocated before
    /// traffic) the layout is empty and this returns after one poll
    /// interval.
    ///
    /// # Errors
    /// When a node's status cannot be read, or the layout is not balanced
    /// within `timeout` (the message holds the last layout).
    pub fn wait_balanced(&self, connector: &dyn Connector, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        let mut last: Option<ShardLayout> = None;
        loop {
            let layout = self.shard_layout(connector)?;
            if layout.balanced() && last.as_ref() == Some(&layout) {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                bail!(
                    "the shards were not balanced within {timeout:?}: {}",
                    layout.describe()
                );
            }
            last = Some(layout);
            std::thread::sleep(BALANCE_POLL);
        }
    }

    /// Every running initial node's hosted shards per entity type and
    /// region, and the coordinators' allocated counts.
    fn shard_layout(&self, connector: &dyn Connector) -> Result<ShardLayout> {
        let mut layout = ShardLayout::default();
        for node in self.nodes[..self.initial]
            .iter()
            .filter(|n| n.child.is_some())
        {
            let status = connector
                .node_status(node.client_address, Duration::from_secs(5))
                .with_context(|| format!("status of {}", node.name))?;
            layout.add(&node.name, &status);
        }
        Ok(layout)
    }

    /// Kills node `i` with SIGKILL and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops node `i`: SIGTERM (graceful leave), then SIGKILL if it has not
    /// exited within `bound`. Returns whether it exited on its own.
    pub fn terminate(&mut self, i: usize, bound: Duration) -> bool {
        let Some(mut child) = self.nodes[i].child.take() else {
            return true;
        };
        // SAFETY: plain kill(2) on the pid of a child we have not reaped yet.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Stops every running node (SIGTERM, SIGKILL after `bound`), all at once.
    pub fn stop_all(&mut self, bound: Duration) {
        for node in &self.nodes {
            if let Some(child) = node.child.as_ref() {
                // SAFETY: kill(2) on an unreaped child's pid.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        for i in 0..self.nodes.len() {
            self.terminate(i, bound);
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop_all(Duration::from_secs(5));
        if self.keep {
            let dir = std::mem::replace(
                &mut self.dir,
                tempfile::TempDir::new().expect("temporary directory"),
            );
            let path = dir.keep();
            eprintln!(
                "kept the cluster's configs, data and logs in {}",
                path.display()
            );
        }
    }
}

/// How often [`LocalCluster::wait_balanced`] reads the nodes' status, and
/// how long the layout must stay unchanged: longer than the coordinator's
/// warm settle time (200 ms), after which a handed-off shard gets its new
/// home.
pub const BALANCE_POLL: Duration = Duration::from_millis(400);

/// Hosted shards per entity type and (node, core) region, and the shards
/// each type's coordinator has allocated, from the nodes' status.
#[derive(Debug, Default, PartialEq, Eq)]
struct ShardLayout {
    hosted: std::collections::BTreeMap<String, std::collections::BTreeMap<(String, u64), Vec<u64>>>,
    allocated: std::collections::BTreeMap<String, u64>,
}

impl ShardLayout {
    /// Adds one node's status (`NodeStatus` as JSON).
    fn add(&mut self, node: &str, status: &serde_json::Value) {
        let regions = status.get("regions").and_then(|r| r.as_array());
        for r in regions.into_iter().flatten() {
            if r.get("proxy").and_then(|p| p.as_bool()) == Some(true) {
                continue;
            }
            let Some(t) = r.get("type_name").and_then(|t| t.as_str()) else {
                continue;
            };
            let core = r.get("core").and_then(|c| c.as_u64()).unwrap_or(0);
            let shards: Vec<u64> = r
                .get("shards")
                .and_then(|s| s.as_object())
                .map(|m| m.keys().filter_map(|k| k.parse().ok()).collect())
                .unwrap_or_default();
            self.hosted
                .entry(t.to_string())
                .or_default()
                .insert((node.to_string(), core), shards);
        }
        if status.get("coordinator_here").and_then(|c| c.as_bool()) == Some(true) {
            let coordinators = status.get("coordinators").and_then(|c| c.as_array());
            for c in coordinators.into_iter().flatten() {
                if let (Some(t), Some(n)) = (
                    c.get("type_name").and_then(|t| t.as_str()),
                    c.get("shards").and_then(|n| n.as_u64()),
                ) {
                    self.allocated.insert(t.to_string(), n);
                }
            }
        }
    }

    /// Every type's regions differ by at most one hosted shard, and every
    /// shard its coordinator allocated is hosted.
    fn balanced(&self) -> bool {
        self.hosted.iter().all(|(t, regions)| {
            let counts: Vec<usize> = regions.values().map(Vec::len).collect();
            let (min, max) = (
                counts.iter().copied().min().unwrap_or(0),
                counts.iter().copied().max().unwrap_or(0),
            );
            let hosted: usize = counts.iter().sum();
            max <= min + 1 && self.allocated.get(t).is_none_or(|n| *n as usize == hosted)
        })
    }

    /// Shards per region of every type, for an error message.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (t, regions) in &self.hosted {
            let counts: Vec<String> = regions
                .iter()
                .map(|((node, core), s)| format!("{node}/{core}: {}", s.len()))
                .collect();
            parts.push(format!(
                "{t}: {} (allocated {})",
                counts.join(", "),
                self.allocated
                    .get(t)
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "?".into())
            ));
        }
        parts.join("; ")
    }
}

fn forward_stdout(stdout: std::process::ChildStdout, mut log: File, ready: mpsc::Sender<()>) {
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if line.starts_with("shardline: ready") {
                    let _ = ready.send(());
                }
                let _ = log.write_all(line.as_bytes());
            }
        }
    }
}

/// The last 20 lines of a log file.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> NodeSpec {
        NodeSpec {
            data_cores: 2,
            pin_cores: false,
            number_of_shards: 100,
            durability: Durability::IntervalMs(5),
            idle_timeout_ms: 0,
            active_entity_limit: 1000,
            extra_toml: String::new(),
        }
    }

    #[test]
    fn configs_hold_every_key_of_the_contract() {
        let a: SocketAddr = "127.0.0.1:7101".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:7201".parse().unwrap();
        let text = node_config(&spec(), a, b, &[a], Path::new("/tmp/x\"y"));
        for key in [
            "cluster_address = \"127.0.0.1:7101\"",
            "client_address = \"127.0.0.1:7201\"",
            "seed_nodes = [\"127.0.0.1:7101\"]",
            "data_cores = 2",
            "pin_cores = false",
            "data_dir = \"/tmp/x\\\"y\"",
            "number_of_shards = 100",
            "durability = { interval_ms = 5 }",
            "name = \"counter\"",
            "kind = \"echo\"",
            "active_entity_limit = 1000",
            "idle_timeout_ms = 0",
        ] {
            assert!(text.contains(key), "missing `{key}` in\n{text}");
        }
        assert_eq!(text.matches("[[entity_types]]").count(), 2);
    }

    #[test]
    fn a_layout_is_balanced_only_when_regions_differ_by_one_and_nothing_hands_off() {
        let node = |shards: &[u32], here: Option<u64>| {
            let map: serde_json::Map<String, serde_json::Value> = shards
                .iter()
                .map(|s| (s.to_string(), serde_json::json!([])))
                .collect();
            let mut v = serde_json::json!({
                "regions": [
                    {"type_name": "counter", "core": 0, "proxy": false, "shards": map},
                    {"type_name": "counter", "core": 1, "proxy": true, "shards": {}}
                ],
                "coordinator_here": here.is_some(),
                "coordinators": []
            });
            if let Some(n) = here {
                v["coordinators"] = serde_json::json!([{"type_name": "counter", "shards": n}]);
            }
            v
        };
        let layout = |a: &[u32], b: &[u32], allocated: u64| {
            let mut l = ShardLayout::default();
            l.add("node-1", &node(a, Some(allocated)));
            l.add("node-2", &node(b, None));
            l
        };
        assert!(layout(&[0, 1], &[2], 3).balanced());
        assert!(!layout(&[0, 1, 2], &[], 3).balanced(), "two apart");
        assert!(!layout(&[0], &[2], 3).balanced(), "shard 1 is handing off");
        assert!(layout(&[], &[], 0).balanced(), "on-demand allocation");
        assert_eq!(layout(&[0, 1], &[2], 3), layout(&[0, 1], &[2], 3));
        assert!(layout(&[0, 1], &[2], 3).describe().contains("node-1/0: 2"));
    }

    #[test]
    fn durability_parses() {
        assert_eq!(Durability::parse("none").unwrap(), Durability::None);
        assert_eq!(Durability::parse("always").unwrap(), Durability::Always);
        assert_eq!(
            Durability::parse("interval:2").unwrap(),
            Durability::IntervalMs(2)
        );
        assert!(Durability::parse("interval:0").is_err());
        assert!(Durability::parse("sometimes").is_err());
    }

    #[test]
    fn free_addresses_are_distinct_loopback() {
        let addrs = free_addresses(6).unwrap();
        let set: std::collections::HashSet<_> = addrs.iter().collect();
        assert_eq!(set.len(), 6);
        assert!(addrs.iter().all(|a| a.ip().is_loopback()));
    }

    #[test]
    fn prepared_cluster_has_configs_and_no_process() {
        let c =
            LocalCluster::prepare(PathBuf::from("/nonexistent/shardline"), 2, 1, &spec()).unwrap();
        assert_eq!(c.nodes.len(), 3);
        assert_eq!(c.client_addresses().len(), 2);
        let spare = std::fs::read_to_string(&c.nodes[2].config_path).unwrap();
        assert!(spare.contains(&c.nodes[0].cluster_address.to_string()));
        assert!(c.nodes.iter().all(|n| n.child.is_none()));
    }
}
