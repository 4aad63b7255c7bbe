//! Graceful leave under load: SIGTERM one of three nodes while clients keep
//! asking through the other two; the node hands its shards off, leaves and
//! exits 0, and no request fails.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardline::client::{Client, Status};

use super::support::{live_entities, Cluster};

const ENTITIES: usize = 150;

#[test]
fn sigterm_leaves_gracefully_without_failed_requests() {
    let _one_at_a_time = super::support::serial();
    let mut cluster = Cluster::start(23_300, 3);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(3, Duration::from_secs(30));
    let addrs = [cluster.ports.client(0), cluster.ports.client(1)];
    let stop = Arc::new(AtomicBool::new(false));
    let mut loaders = Vec::new();
    for (t, addr) in addrs.into_iter().enumerate() {
        let stop = stop.clone();
        loaders.push(std::thread::spawn(move || {
            let mut c = Client::connect(addr).expect("connect");
            let mut done = 0u64;
            let mut failures = Vec::new();
            let mut r = 0usize;
            while !stop.load(Ordering::Relaxed) {
                for e in (t..ENTITIES).step_by(2) {
                    let payload = format!("t{t}-r{r}-e{e}");
                    match c.ask(
                        "echo",
                        &format!("e-{e}"),
                        payload.as_bytes(),
                        Duration::from_secs(20),
                    ) {
                        Ok(resp) if resp.status == Status::Ok => {
                            assert_eq!(resp.payload, payload.as_bytes());
                            done += 1;
                        }
                        Ok(resp) => failures.push(format!(
                            "e-{e}: {:?} {}",
                            resp.status,
                            String::from_utf8_lossy(&resp.payload)
                        )),
                        Err(err) => failures.push(format!("e-{e}: {err}")),
                    }
                }
                r += 1;
            }
            (done, failures)
        }));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let before = live_entities(cluster.ports.client(2), "echo").expect("status");
    assert!(!before.is_empty(), "node 2 hosts entities before leaving");

    let mut leaving = cluster.nodes[2].take().expect("node 2");
    leaving.signal(libc::SIGTERM);
    let st = leaving.wait_exit(Duration::from_secs(45));
    let log2 = std::fs::read_to_string(cluster.dir.path().join("node-2.log")).unwrap_or_default();
    let st = st.unwrap_or_else(|| panic!("node 2 did not exit after SIGTERM; log:\n{log2}"));
    assert!(st.success(), "node 2 exited with {st:?}; log:\n{log2}");
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for l in loaders {
        let (done, failures) = l.join().expect("loader");
        assert!(
            failures.is_empty(),
            "failed requests during the leave: {failures:?}\nnode 0 log:\n{}",
            cluster.log(0)
        );
        total += done;
    }
    assert!(total > 0);
    // Every entity now lives on exactly one of the remaining nodes.
    let mut all = Vec::new();
    for i in 0..2 {
        all.extend(live_entities(cluster.ports.client(i), "echo").expect("status"));
    }
    for id in &before {
        assert_eq!(
            all.iter().filter(|x| *x == id).count(),
            1,
            "{id} after the leave"
        );
    }
}
