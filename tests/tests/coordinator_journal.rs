//! The coordinator's state in the control core's journal
//! (`{data_dir}/control`), recovered by a new coordinator:
//!
//! - SIGKILL of the coordinator's node in a 3-node cluster: the next oldest
//!   member's coordinator (node 1 or node 2, whichever was up first) recovers the allocations from the dead node's
//!   control journal (read-only, same data root), and durable counters keep
//!   answering with their values;
//! - whole-cluster restart of 2 nodes: the allocation recorded before is
//!   recovered from the journals (nothing is left in memory anywhere);
//! - a restart with another `number_of_shards`: the coordinator refuses to
//!   start and says why in the status.
//!
//! Ports 25400-25599.

#[path = "node_cases/support.rs"]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use shardline::status::CoordinatorStatusView;
use support::{config_text, serial, shardline_bin, spawn_node, status, Cluster, NodeProc, Ports};

const COUNTERS: usize = 60;

/// Starts `shardline node` with `cfg`, its stderr appended to `log`.
fn spawn(cfg: &Path, log: &Path) -> NodeProc {
    spawn_node(&shardline_bin(), cfg, log, "info")
}

/// The `counter` coordinator's view on the node at client port of `i`, when
/// it runs there.
fn counter_coordinator(cluster: &Cluster, i: usize) -> Option<CoordinatorStatusView> {
    let st = status(cluster.ports.client(i))?;
    st.coordinators
        .into_iter()
        .find(|c| c.type_name == "counter")
}

/// Waits until `f` returns `Some`, failing with `what` after `timeout`.
fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asks `payload` of counters `c-0..COUNTERS` through `clients` in turn and
/// asserts each answers `Ok` with `want`.
fn ask_all(clients: &mut [Client], payload: &str, want: &str, cluster: &Cluster) {
    for i in 0..COUNTERS {
        let n = clients.len();
        let c = &mut clients[i % n];
        let id = format!("c-{i}");
        let r = c
            .ask("counter", &id, payload.as_bytes(), Duration::from_secs(40))
            .unwrap_or_else(|e| panic!("{payload} {id}: {e}"));
        assert_eq!(
            (r.status, String::from_utf8_lossy(&r.payload).as_ref()),
            (Status::Ok, want),
            "{payload} {id}; logs:\n{}\n---\n{}",
            cluster.log(0),
            cluster.log(1)
        );
    }
}

#[test]
fn killed_coordinator_is_recovered_from_its_control_journal() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let mut cluster = Cluster::start(25_400, 3);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(3, Duration::from_secs(30));
    let mut clients: Vec<Client> = [1, 2]
        .iter()
        .map(|i| Client::connect(cluster.ports.client(*i)).expect("connect"))
        .collect();
    ask_all(&mut clients, "add 3", "3", &cluster);
    let before = counter_coordinator(&cluster, 0).expect("coordinator on node 0 (oldest)");
    assert_eq!(before.recovered_from, "empty", "{before:?}");
    assert!(before.writer_epoch > 0 && before.shards > 0, "{before:?}");
    let journal0 = cluster.dir.path().join("node-0").join("control");
    assert!(journal0.is_dir(), "control journal of node 0");

    let victim = cluster.nodes[0].take().expect("node 0");
    victim.signal(libc::SIGKILL);
    drop(victim);
    let killed_at = Instant::now();

    // The next oldest member (node 1 or node 2: the one whose join was
    // made `Up` first, which the test does not control) runs the coordinator
    // once node 0 is removed; it recovers from node 0's control journal.
    let after = wait_for(
        Duration::from_secs(45),
        "a coordinator on node 1 or 2",
        || counter_coordinator(&cluster, 1).or_else(|| counter_coordinator(&cluster, 2)),
    );
    println!(
        "coordinator on a survivor after {:?}: {after:?}",
        killed_at.elapsed()
    );
    assert_eq!(after.recovered_from, "journal", "{after:?}");
    assert!(
        after
            .journal_dir
            .as_deref()
            .is_some_and(|d| d.ends_with("node-0/control")),
        "{after:?}"
    );
    assert!(after.recovered_records > 0, "{after:?}");
    assert!(
        after.recovered_shards >= before.shards,
        "recovered {after:?}, before {before:?}"
    );
    assert!(after.writer_epoch > before.writer_epoch, "{after:?}");
    assert!(after.refused.is_none(), "{after:?}");
    // Routing works; durable counters kept their values.
    ask_all(&mut clients, "add 1", "4", &cluster);
    println!(
        "coordinator failover from the journal: {COUNTERS} counters answer {:?} after the kill (test {:?})",
        killed_at.elapsed(),
        t0.elapsed()
    );
}

#[test]
fn whole_cluster_restart_recovers_the_recorded_allocation() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let mut cluster = Cluster::start(25_500, 2);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(2, Duration::from_secs(30));
    let mut clients: Vec<Client> = (0..2)
        .map(|i| Client::connect(cluster.ports.client(i)).expect("connect"))
        .collect();
    ask_all(&mut clients, "add 2", "2", &cluster);
    let before = counter_coordinator(&cluster, 0).expect("coordinator on node 0 (oldest)");
    assert!(before.shards > 0, "{before:?}");
    drop(clients);

    // Stop the whole cluster hard: nothing survives in memory.
    for i in 0..2 {
        let n = cluster.nodes[i].take().expect("node");
        n.signal(libc::SIGKILL);
        drop(n);
    }
    for i in 0..2 {
        let cfg = cluster.dir.path().join(format!("node-{i}.toml"));
        let log = cluster.dir.path().join(format!("node-{i}.log"));
        cluster.nodes[i] = Some(spawn(&cfg, &log));
    }
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(2, Duration::from_secs(30));
    let after = wait_for(Duration::from_secs(30), "a coordinator", || {
        counter_coordinator(&cluster, 0).or_else(|| counter_coordinator(&cluster, 1))
    });
    println!("after the restart: {after:?}");
    assert_eq!(after.recovered_from, "journal", "{after:?}");
    assert_eq!(
        after.recovered_shards, before.shards,
        "the allocation recorded before the restart: {before:?} / {after:?}"
    );
    assert!(after.recovered_records > 0, "{after:?}");
    assert!(after.writer_epoch > before.writer_epoch, "{after:?}");
    let mut clients: Vec<Client> = (0..2)
        .map(|i| Client::connect(cluster.ports.client(i)).expect("connect"))
        .collect();
    ask_all(&mut clients, "add 1", "3", &cluster);
    println!("whole-cluster restart recovered in {:?}", t0.elapsed());
}

#[test]
fn a_coordinator_whose_number_of_shards_disagrees_with_its_journal_refuses_to_start() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 25_580 };
    let text = config_text(ports, 0, 1, 1, dir.path(), "");
    let cfg = dir.path().join("node-0.toml");
    let log = dir.path().join("node-0.log");
    std::fs::write(&cfg, &text).expect("write config");
    let mut node = spawn(&cfg, &log);
    node.ready
        .recv_timeout(Duration::from_secs(60))
        .expect("node ready");
    let mut c = Client::connect(ports.client(0)).expect("connect");
    let r = c
        .ask("counter", "x", b"add 1", Duration::from_secs(20))
        .expect("ask");
    assert_eq!(r.status, Status::Ok);
    drop(c);
    node.signal(libc::SIGTERM);
    node.wait_exit(Duration::from_secs(20)).expect("exit");
    drop(node);

    let changed = text.replace("number_of_shards = 60", "number_of_shards = 61");
    assert_ne!(changed, text, "config template changed");
    std::fs::write(&cfg, changed).expect("write config");
    let node = spawn(&cfg, &log);
    let refused = wait_for(Duration::from_secs(30), "a refused coordinator", || {
        let st = status(ports.client(0))?;
        st.coordinators
            .into_iter()
            .find(|c| c.type_name == "counter" && c.refused.is_some())
    });
    let why = refused.refused.unwrap_or_default();
    assert!(
        why.contains("number_of_shards = 60") && why.contains("number_of_shards = 61"),
        "{why}"
    );
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.contains("coordinator refused to start"),
        "log:\n{logged}"
    );
    drop(node);
}
