//! Helpers of the node tests: generate configs into a temp dir, start
//! `shardline node` children, wait for their ready line, kill them on drop.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use shardline::NodeStatus;

/// The `shardline` binary of the same profile as this test binary, brought
/// up to date with `cargo build --workspace --bins` once per test process (a
/// no-op when fresh; this also keeps a stale binary from an older checkout
/// from being used).
pub fn shardline_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("current exe");
            // target/<profile>/deps/<test>-<hash>
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("profile dir")
                .to_path_buf();
            let target_dir = profile_dir.parent().expect("target dir").to_path_buf();
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            // The same command as `scripts/test`'s first step: building
            // `-p shardline` alone resolves the dependencies' features
            // differently, so it would rebuild the engine (minutes) and
            // flip the binary back and forth with every workspace build.
            cmd.args(["build", "-q", "--workspace", "--bins"])
                .env("CARGO_TARGET_DIR", &target_dir)
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            if release {
                cmd.arg("--release");
            }
            let st = cmd.status().expect("run cargo build");
            assert!(st.success(), "building the shardline binary failed");
            profile_dir.join("shardline")
        })
        .clone()
}

/// Ports of one test's cluster: node i (0-based) uses `base + i` for the
/// cluster, `base + 50 + i` for native clients and `base + 100 + i` for
/// HTTP.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// First cluster port.
    pub base: u16,
}

impl Ports {
    pub fn cluster(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.base + i as u16))
    }
    pub fn client(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.base + 50 + i as u16))
    }
    pub fn http(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.base + 100 + i as u16))
    }
}

/// A node config for node `i` of `n`.
pub fn config_text(
    ports: Ports,
    i: usize,
    n: usize,
    cores: u16,
    dir: &Path,
    extra: &str,
) -> String {
    let seeds: Vec<String> = (0..n)
        .map(|j| format!("\"{}\"", ports.cluster(j)))
        .collect();
    format!(
        r#"cluster_address = "{}"
client_address = "{}"
seed_nodes = [{}]
data_cores = {cores}
pin_cores = false
data_dir = "{}"
number_of_shards = 60
durability = "none"
downing_stable_after_ms = 2000
heartbeat_pause_ms = 1500
{extra}
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0

[[entity_types]]
name = "echo"
kind = "echo"
stateless_worker = false
idle_timeout_ms = 0
active_entity_limit = 0
"#,
        ports.cluster(i),
        ports.client(i),
        seeds.join(", "),
        dir.join(format!("node-{i}")).display()
    )
}

/// One child node.
pub struct NodeProc {
    pub child: Child,
    pub ready: std::sync::mpsc::Receiver<()>,
}

impl NodeProc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends a signal to the child.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Waits for the child to exit; `None` on timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A set of child nodes sharing a temp dir.
pub struct Cluster {
    pub nodes: Vec<Option<NodeProc>>,
    pub ports: Ports,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// Writes the configs of `n` nodes and starts them all at once.
    pub fn start(base_port: u16, n: usize) -> Cluster {
        Self::start_with_cores(base_port, n, 1)
    }

    /// Like [`Self::start`] with `cores` data cores per node.
    pub fn start_with_cores(base_port: u16, n: usize, cores: u16) -> Cluster {
        Self::start_with_extra(base_port, n, cores, "")
    }

    /// Like [`Self::start_with_cores`], with `extra` TOML appended to every
    /// node's config before the built-in entity types (top-level keys, or
    /// more `[[entity_types]]` tables).
    pub fn start_with_extra(base_port: u16, n: usize, cores: u16, extra: &str) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports = Ports { base: base_port };
        let bin = shardline_bin();
        let mut nodes = Vec::new();
        for i in 0..n {
            let cfg = dir.path().join(format!("node-{i}.toml"));
            std::fs::write(&cfg, config_text(ports, i, n, cores, dir.path(), extra))
                .expect("write config");
            nodes.push(Some(spawn_node(
                &bin,
                &cfg,
                &dir.path().join(format!("node-{i}.log")),
                "info",
            )));
        }
        Cluster { nodes, ports, dir }
    }

    /// Waits until every running node printed its ready line.
    pub fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            let left = deadline.saturating_duration_since(Instant::now());
            if n.ready.recv_timeout(left).is_err() {
                panic!(
                    "node {i} not ready within {timeout:?}; log:\n{}",
                    self.log(i)
                );
            }
        }
    }

    /// Waits until every node sees `n` members Up.
    pub fn wait_members_up(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self.live().all(|i| {
                status(self.ports.client(i))
                    .map(|s| s.members.iter().filter(|m| m.status == "Up").count() == n)
                    .unwrap_or(false)
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster did not reach {n} Up members in {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Indices of nodes still running (not taken out by the test).
    pub fn live(&self) -> impl Iterator<Item = usize> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.is_some())
            .map(|(i, _)| i)
    }

    pub fn log(&self, i: usize) -> String {
        let s = std::fs::read_to_string(self.dir.path().join(format!("node-{i}.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

impl Drop for Cluster {
    /// On a failing test, keeps the nodes' logs in
    /// `$TMPDIR/shardline-test-logs/<base port>/` for the post-mortem.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let keep = std::env::temp_dir()
                .join("shardline-test-logs")
                .join(self.ports.base.to_string());
            let _ = std::fs::create_dir_all(&keep);
            for i in 0..self.nodes.len() {
                let name = format!("node-{i}.log");
                let _ = std::fs::copy(self.dir.path().join(&name), keep.join(&name));
            }
            eprintln!("node logs kept in {}", keep.display());
        }
    }
}

/// Starts `shardline node --config cfg` (binary `bin`) with `RUST_LOG =
/// rust_log`, its stderr appended to `log`; the returned child's `ready`
/// receives once when the node prints its ready line.
pub fn spawn_node(bin: &Path, cfg: &Path, log: &Path, rust_log: &str) -> NodeProc {
    spawn_node_with_args(bin, cfg, log, rust_log, &[])
}

/// [`spawn_node`] with more arguments after `node --config CFG` (e.g.
/// `--leave-timeout-ms 4000`).
pub fn spawn_node_with_args(
    bin: &Path,
    cfg: &Path,
    log: &Path,
    rust_log: &str,
    args: &[&str],
) -> NodeProc {
    spawn_node_under(&[], bin, cfg, log, rust_log, args)
}

/// [`spawn_node_with_args`] run by the command `wrapper` (e.g. `["prlimit",
/// "--nofile=600:600", "--"]`, which execs the node in its own process);
/// no wrapper when empty.
pub fn spawn_node_under(
    wrapper: &[&str],
    bin: &Path,
    cfg: &Path,
    log: &Path,
    rust_log: &str,
    args: &[&str],
) -> NodeProc {
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    let mut cmd = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let mut child = cmd
        .args(["node", "--config"])
        .arg(cfg)
        .args(args)
        .env("RUST_LOG", rust_log)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(logf))
        .spawn()
        .expect("spawn shardline node");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("shardline: ready") {
                let _ = tx.send(());
            }
        }
    });
    NodeProc { child, ready: rx }
}

/// [`spawn_node`], then waits up to `timeout` for the ready line; panics
/// with the log's contents when it does not come.
pub fn start_ready(
    bin: &Path,
    cfg: &Path,
    log: &Path,
    rust_log: &str,
    timeout: Duration,
) -> NodeProc {
    let node = spawn_node(bin, cfg, log, rust_log);
    if node.ready.recv_timeout(timeout).is_err() {
        panic!(
            "node not ready within {timeout:?}; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    node
}

/// A node's status, or `None` when it does not answer.
pub fn status(addr: SocketAddr) -> Option<NodeStatus> {
    let mut c = Client::connect(addr).ok()?;
    c.node_status(Duration::from_secs(3)).ok()
}

/// Entity ids of `type_name` live on the node at `addr`, with their shards.
pub fn live_entities(addr: SocketAddr, type_name: &str) -> Option<Vec<String>> {
    let s = status(addr)?;
    Some(
        s.regions
            .iter()
            .filter(|r| r.type_name == type_name)
            .flat_map(|r| r.shards.values().flatten().cloned())
            .collect(),
    )
}

/// Asks `get` of every counter `prefix-0..n` once (allocating their shards),
/// then waits until the coordinator's allocation is balanced (the shard
/// counts of all `counter` regions differ by at most one), so that no
/// rebalance moves a counter (and resets its in-memory value) during the
/// test.
pub fn allocate_and_balance(clients: &mut [Client], nodes: &[SocketAddr], prefix: &str, n: usize) {
    for c in 0..n {
        let cl = &mut clients[c % clients.len()];
        let r = cl
            .ask(
                "counter",
                &format!("{prefix}-{c}"),
                b"get",
                Duration::from_secs(20),
            )
            .expect("warm-up ask");
        assert_eq!(r.status, Status::Ok, "warm-up of {prefix}-{c}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut counts = Vec::new();
        for a in nodes {
            if let Some(st) = status(*a) {
                for r in st.regions.iter().filter(|r| r.type_name == "counter") {
                    counts.push(r.shards.len());
                }
            }
        }
        let (min, max) = (
            counts.iter().min().copied().unwrap_or(0),
            counts.iter().max().copied().unwrap_or(0),
        );
        if !counts.is_empty() && max <= min + 1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "allocation never balanced: {counts:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Runs the node tests one at a time: each starts several node processes,
/// and running them side by side on a 2-core machine would starve the
/// failure detectors into false suspicions.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
