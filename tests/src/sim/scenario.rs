//! The scenarios: each builds the world's parameters and a timed script of
//! faults and membership changes.

use std::time::Duration;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use shardline_core::sharding::{
    CoordinatorSettings, PassivationSettings, RegionSettings, RememberEntitiesPace,
};

use super::world::SimConfig;

/// A scripted step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// The node at this slot crashes (the members' failure detectors find
    /// out; the split-brain resolver downs it).
    Crash(usize),
    /// The node at this slot restarts at the same address with a new uid.
    Restart(usize),
    /// The node that crashed last restarts at the same address.
    RestartCrashed,
    /// A new node joins (next free slot).
    Join,
    /// The node at this slot leaves gracefully.
    Leave(usize),
    /// The node that hosts the coordinator now leaves gracefully.
    LeaveCoordinatorNode,
    /// The node that hosts the coordinator now crashes.
    CrashCoordinatorNode,
    /// A random non-coordinator node crashes.
    CrashOther,
    /// These slots are cut off from all others.
    Partition(Vec<usize>),
    /// The coordinator's node is cut off from all others.
    PartitionCoordinatorNode,
    /// All partitions heal.
    Heal,
    /// Check that the Up regions' shard counts differ by at most 1.
    CheckBalanced,
    /// The node at this slot gets no input (a frozen
    /// process).
    Pause(usize),
    /// It gets input again, its membership first.
    Resume(usize),
}

/// The knobs of one run.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub coordinator: CoordinatorSettings,
    pub region: RegionSettings,
    /// Mean messages per second (virtual) over the whole world.
    pub rate_per_s: f64,
    /// Senders stop at this time.
    pub workload_until: Duration,
    /// The run ends here (after draining).
    pub run_until: Duration,
    /// Probability that an entity asks to passivate after a message.
    pub p_passivate: f64,
    /// How long an entity takes to process its stop message (min, max).
    pub stop_time: (Duration, Duration),
    /// Replay every ShardStopped to the coordinator once more, later.
    pub dup_shard_stopped: bool,
    /// Skewed ids: 80% of messages go to 10% of the entities.
    pub skewed: bool,
    /// Node 0 also runs a proxy region (routes, hosts nothing) with a sender.
    pub proxy: bool,
    /// Nodes at the start when the scenario fixes it (else the config's).
    pub nodes: Option<usize>,
    /// Exactly these slots run at the end (`None`: the script decides at
    /// run time, e.g. the coordinator's member crashes).
    pub expect_survivors: Option<Vec<usize>>,
    /// How long after a journal write it is durable and
    /// the writer's plane is told (min, max; in order per node).
    pub journal_ack: (Duration, Duration),
    /// How long a coordinator recovery read takes (min, max).
    pub recovery_delay: (Duration, Duration),
    /// The share of recovery reads answered as the
    /// database does (claiming the next writer epoch at the read), the
    /// others as a file journal (the plane picks the epoch).
    pub p_database: f64,
    /// The timeout of a graceful leave (the hand-offs get
    /// half of it).
    pub leave_timeout: Duration,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

impl Params {
    /// `cfg.nodes` nodes under load for 20 s, the run ends at 40 s; every
    /// node survives. The scripted scenarios start here and go through
    /// [`after_forming`].
    fn base(cfg: &SimConfig) -> Self {
        Self {
            coordinator: CoordinatorSettings {
                min_nr_of_members: 1,
                rebalance_interval: s(2),
                handoff_timeout: s(10),
                ..CoordinatorSettings::default()
            },
            region: RegionSettings {
                buffer_size: 10_000,
                retry_interval: s(1),
                passivation: PassivationSettings {
                    idle_timeout: Some(s(120)),
                    active_entity_limit: None,
                },
                remember_entities: false,
                remember_entities_pace: RememberEntitiesPace::AllAtOnce,
            },
            rate_per_s: 25.0 * cfg.nodes as f64,
            workload_until: s(20),
            run_until: s(40),
            p_passivate: 0.0,
            stop_time: (ms(1), ms(5)),
            dup_shard_stopped: false,
            skewed: false,
            proxy: false,
            nodes: None,
            expect_survivors: Some((0..cfg.nodes).collect()),
            journal_ack: (Duration::from_micros(100), ms(2)),
            recovery_delay: (ms(1), ms(10)),
            p_database: 0.0,
            leave_timeout: s(20),
        }
    }

    /// `nodes` nodes (the `cluster-*` scenarios): the cluster forms first (the first
    /// seed's 5 s timeout and a few gossip rounds), so the load and the run
    /// are longer.
    fn clustered(cfg: &SimConfig, nodes: usize) -> Self {
        let mut p = Self::base(cfg);
        p.nodes = Some(nodes);
        p.rate_per_s = 25.0 * nodes as f64;
        p.workload_until = s(45);
        p.run_until = s(70);
        p.expect_survivors = Some((0..nodes).collect());
        p
    }
}

/// A scripted scenario on a cluster that forms first: its script, the end
/// of its load and of its run move [`FORMED_BY_MS`] later (the load starts
/// at once, as in every run: regions buffer until the coordinator runs).
fn after_forming(mut p: Params, script: Script) -> (Params, Script) {
    let formed = ms(FORMED_BY_MS);
    p.workload_until += formed;
    p.run_until += formed;
    let script = script.into_iter().map(|(t, a)| (t + formed, a)).collect();
    (p, script)
}

/// Every slot but `gone` (of `nodes`).
fn all_but(nodes: usize, gone: usize) -> Option<Vec<usize>> {
    Some((0..nodes).filter(|&i| i != gone).collect())
}

/// A clustered graceful leave of `victim` whose hand-offs time out in
/// half the runs.
fn leave_timeout(
    rng: &mut ChaCha8Rng,
    p: &mut Params,
    nodes: usize,
    victim: usize,
) -> (Params, Script) {
    if rng.gen_bool(0.5) {
        p.stop_time = (s(6), s(9));
        p.leave_timeout = s(10);
    }
    p.expect_survivors = Some((0..nodes).filter(|&i| i != victim).collect());
    let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 10_000);
    (p.clone(), vec![(t, Action::Leave(victim))])
}

/// Scenarios that show an open bug (none at present): run only by name
/// (`--scenario`), not in the `--seeds` sweep of every scenario.
pub static OPEN_SCENARIOS: &[Scenario] = &[];

/// Clustered runs: the cluster has formed and the coordinator runs by then.
const FORMED_BY_MS: u64 = 12_000;

fn shuffled(rng: &mut ChaCha8Rng, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.gen_range(0..=i);
        v.swap(i, j);
    }
    v
}

/// A timed script of actions.
pub(crate) type Script = Vec<(Duration, Action)>;

/// A named scenario.
pub struct Scenario {
    /// Its name (for `--scenario`).
    pub name: &'static str,
    /// What it exercises.
    pub about: &'static str,
    pub(crate) build: fn(&mut ChaCha8Rng, &SimConfig) -> (Params, Script),
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

fn rand_time(rng: &mut ChaCha8Rng, lo_ms: u64, hi_ms: u64) -> Duration {
    ms(rng.gen_range(lo_ms..=hi_ms))
}

/// Every scenario, in the order they run.
pub static SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "steady",
        about: "steady state: uniform and skewed load, no faults",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.skewed = rng.gen_bool(0.5);
            p.proxy = true;
            after_forming(p, vec![])
        },
    },
    Scenario {
        name: "join",
        about: "nodes join under load; rebalancing converges to a difference of at most 1",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.proxy = true;
            p.region.remember_entities = rng.gen_bool(0.5);
            p.workload_until = s(45);
            p.run_until = s(60);
            let t1 = rand_time(rng, 3000, 8000);
            let mut script = vec![(t1, Action::Join)];
            let mut last = t1;
            if rng.gen_bool(0.5) {
                last = t1 + rand_time(rng, 0, 4000);
                script.push((last, Action::Join));
            }
            p.expect_survivors = Some((0..cfg.nodes + script.len()).collect());
            // 15 rounds of 2 s after the last join.
            script.push((last + s(30), Action::CheckBalanced));
            after_forming(p, script)
        },
    },
    Scenario {
        name: "leave",
        about: "a node (possibly the coordinator's) leaves gracefully under load",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            let t = rand_time(rng, 3000, 10_000);
            let a = if rng.gen_bool(0.3) {
                p.expect_survivors = None;
                Action::LeaveCoordinatorNode
            } else {
                let v = rng.gen_range(0..cfg.nodes);
                p.expect_survivors = all_but(cfg.nodes, v);
                Action::Leave(v)
            };
            after_forming(p, vec![(t, a)])
        },
    },
    Scenario {
        name: "crash",
        about: "a node crashes under load (detected, downed and removed by the members) and later restarts",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            let t = rand_time(rng, 3000, 10_000);
            let mut script = vec![(t, Action::CrashOther)];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 4000, 8000), Action::RestartCrashed));
            } else {
                // Which node it is shows only at run time.
                p.expect_survivors = None;
            }
            after_forming(p, script)
        },
    },
    Scenario {
        name: "crash-remember",
        about: "remember entities: a node (possibly the coordinator's) crashes; its shards start again elsewhere without a message",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.region.remember_entities = true;
            if rng.gen_bool(0.5) {
                p.region.remember_entities_pace = RememberEntitiesPace::Constant {
                    per_interval: 3,
                    interval: ms(100),
                };
            }
            let t = rand_time(rng, 3000, 10_000);
            let a = if rng.gen_bool(0.3) {
                Action::CrashCoordinatorNode
            } else {
                Action::CrashOther
            };
            let mut script = vec![(t, a)];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 1000, 8000), Action::RestartCrashed));
            } else {
                p.expect_survivors = None;
            }
            after_forming(p, script)
        },
    },
    Scenario {
        name: "coordinator-crash",
        about: "the coordinator's node crashes; the next oldest recovers the journal",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.proxy = true;
            let t = rand_time(rng, 2000, 10_000);
            let mut script = vec![(t, Action::CrashCoordinatorNode)];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 1000, 5000), Action::RestartCrashed));
            } else {
                p.expect_survivors = None;
            }
            after_forming(p, script)
        },
    },
    Scenario {
        name: "passivation",
        about: "passivation churn under load: Passivate, idle timeout, active-entity limit, a join",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.p_passivate = 0.05;
            p.region.passivation = PassivationSettings {
                idle_timeout: Some(ms(rng.gen_range(500..=2000))),
                active_entity_limit: Some(rng.gen_range(2..=8)),
            };
            p.skewed = rng.gen_bool(0.5);
            p.stop_time = (ms(1), ms(50));
            p.expect_survivors = Some((0..=cfg.nodes).collect());
            after_forming(p, vec![(rand_time(rng, 3000, 8000), Action::Join)])
        },
    },
    Scenario {
        name: "buffer-overflow",
        about: "the coordinator's node is cut off while senders keep sending: BufferFull, then drain (a cut longer than detection and stable_after downs it)",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.region.buffer_size = rng.gen_range(5..=30);
            p.expect_survivors = None;
            let t = rand_time(rng, 0, 1000);
            let heal = t + rand_time(rng, 5000, 12_000);
            after_forming(
                p,
                vec![(t, Action::PartitionCoordinatorNode), (heal, Action::Heal)],
            )
        },
    },
    Scenario {
        name: "slow-handoff",
        about: "an owner slower to stop than handoff_timeout: the hand-off is abandoned, one owner stays",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.coordinator.handoff_timeout = s(2);
            p.stop_time = (ms(1000), ms(4000));
            p.workload_until = s(30);
            p.run_until = s(50);
            p.expect_survivors = Some((0..=cfg.nodes).collect());
            after_forming(p, vec![(rand_time(rng, 2000, 6000), Action::Join)])
        },
    },
    Scenario {
        name: "late-shard-stopped",
        about: "every ShardStopped reaches the coordinator again, late, after the shard moved",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.dup_shard_stopped = true;
            p.workload_until = s(30);
            p.run_until = s(50);
            let t1 = rand_time(rng, 2000, 5000);
            let t2 = t1 + rand_time(rng, 2000, 6000);
            let t3 = t2 + rand_time(rng, 2000, 6000);
            let v = rng.gen_range(0..cfg.nodes);
            p.expect_survivors = all_but(cfg.nodes + 2, v);
            after_forming(
                p,
                vec![
                    (t1, Action::Join),
                    (t2, Action::Join),
                    (t3, Action::Leave(v)),
                ],
            )
        },
    },
    Scenario {
        name: "restart-during-rebalance",
        about: "a node restarts at the same address (new uid) while shards move",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.region.remember_entities = true;
            p.region.remember_entities_pace = RememberEntitiesPace::Constant {
                per_interval: 3,
                interval: ms(100),
            };
            p.workload_until = s(30);
            p.run_until = s(50);
            p.expect_survivors = Some((0..=cfg.nodes).collect());
            let t1 = rand_time(rng, 2000, 5000);
            let victim = rng.gen_range(1..cfg.nodes.max(2));
            let t2 = t1 + rand_time(rng, 1500, 3000);
            let t3 = t2 + rand_time(rng, 200, 4000);
            after_forming(
                p,
                vec![
                    (t1, Action::Join),
                    (t2, Action::Crash(victim.min(cfg.nodes - 1))),
                    (t3, Action::Restart(victim.min(cfg.nodes - 1))),
                ],
            )
        },
    },
    Scenario {
        name: "simultaneous-start",
        about: "all nodes start at the same moment with min_nr_of_members = all of them",
        build: |_rng, cfg| {
            let mut p = Params::base(cfg);
            p.coordinator.min_nr_of_members = cfg.nodes;
            after_forming(p, vec![])
        },
    },
    Scenario {
        name: "partition",
        about: "nodes are partitioned from each other and heal, twice; a second cut while the members still gossip the first one's observations may make the split-brain resolver down the members it finds indirectly connected",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            // Each cut is shorter than detection plus stable_after, but the
            // second one can keep the first one's unreachability record
            // from being gossiped as healed: who survives is the
            // resolver's decision.
            p.expect_survivors = None;
            let mut script = Vec::new();
            let mut t = rand_time(rng, 1000, 4000);
            for _ in 0..2 {
                let victim = rng.gen_range(0..cfg.nodes);
                script.push((t, Action::Partition(vec![victim])));
                t += rand_time(rng, 1000, 5000);
                script.push((t, Action::Heal));
                t += rand_time(rng, 1000, 3000);
            }
            after_forming(p, script)
        },
    },
    Scenario {
        name: "cluster-steady",
        about: "clustered membership (gossip, phi, SBR, singleton) forms under load, no faults",
        build: |rng, cfg| {
            let mut p = Params::clustered(cfg, 3 + rng.gen_range(0..3));
            p.skewed = rng.gen_bool(0.5);
            (p, vec![])
        },
    },
    Scenario {
        name: "cluster-partition-3-2",
        about: "clustered, 5 nodes split 3|2 under load: the minority downs itself, its shards move to the majority",
        build: |rng, cfg| {
            let mut p = Params::clustered(cfg, 5);
            p.region.remember_entities = rng.gen_bool(0.5);
            let order = shuffled(rng, 5);
            let mut minor = order[3..].to_vec();
            minor.sort_unstable();
            let mut major = order[..3].to_vec();
            major.sort_unstable();
            p.expect_survivors = Some(major);
            let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 3000);
            let mut script = vec![(t, Action::Partition(minor))];
            if rng.gen_bool(0.5) {
                // Heal after the minority stopped: nothing comes back.
                script.push((t + rand_time(rng, 20_000, 25_000), Action::Heal));
            }
            (p, script)
        },
    },
    Scenario {
        name: "cluster-pause",
        about: "clustered, a member is paused longer than 2 x stable_after and resumes: it stops before it handles a message",
        build: |rng, cfg| {
            let mut p = Params::clustered(cfg, 5);
            let victim = rng.gen_range(0..5);
            p.expect_survivors = Some((0..5).filter(|&i| i != victim).collect());
            let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 3000);
            // Longer than 2 x stable_after plus detection and removal (as in
            // the membership simulation): the others have downed it.
            let pause = rand_time(rng, 20_000, 30_000);
            (
                p,
                vec![(t, Action::Pause(victim)), (t + pause, Action::Resume(victim))],
            )
        },
    },
    Scenario {
        name: "cluster-journal-late",
        about: "clustered, the coordinator journal acknowledges 50-800 ms late: the coordinator's region messages wait until their events are durable; in half the runs its member crashes, losing what was not durable",
        build: |rng, cfg| {
            let nodes = 3 + rng.gen_range(0..3);
            let mut p = Params::clustered(cfg, nodes);
            p.journal_ack = (ms(50), ms(800));
            p.region.remember_entities = rng.gen_bool(0.5);
            let mut script = vec![];
            if rng.gen_bool(0.5) {
                let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 10_000);
                script.push((t, Action::CrashCoordinatorNode));
                // Which member it is shows only at run time.
                p.expect_survivors = None;
            }
            (p, script)
        },
    },
    Scenario {
        name: "cluster-coordinator-recovery",
        about: "clustered, the coordinator's member crashes (maybe restarting, maybe its successor too): recovery reads take 0.2-3 s, half answered as the database (claiming the epoch), half as a file journal; unacknowledged events are lost, so members' replicated copies run ahead of the journal, which must win",
        build: |rng, cfg| {
            let nodes = 4 + rng.gen_range(0..2);
            let mut p = Params::clustered(cfg, nodes);
            p.journal_ack = (ms(5), ms(300));
            p.recovery_delay = (ms(200), ms(3000));
            p.p_database = 0.5;
            p.expect_survivors = None;
            let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 5000);
            let mut script = vec![(t, Action::CrashCoordinatorNode)];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 15_000, 20_000), Action::RestartCrashed));
            } else if nodes == 5 {
                // Its successor crashes too (3 of 5 stay: a majority).
                script.push((t + rand_time(rng, 15_000, 20_000), Action::CrashCoordinatorNode));
            }
            (p, script)
        },
    },
    Scenario {
        name: "cluster-leave-timeout",
        about: "clustered, a member other than the first seed leaves gracefully through its plane; in half the runs its entities take 6-9 s to stop, longer than the hand-off half of a 10 s leave timeout, so it leaves anyway",
        build: |rng, cfg| {
            let nodes = 3 + rng.gen_range(0..3);
            let mut p = Params::clustered(cfg, nodes);
            // Slot 0 forms the cluster and is the oldest, so it runs the
            // coordinator: its leave is `cluster-leave-coordinator-timeout`.
            let victim = rng.gen_range(1..nodes);
            leave_timeout(rng, &mut p, nodes, victim)
        },
    },
    Scenario {
        name: "cluster-leave-coordinator-timeout",
        about: "clustered, the coordinator's member (the first seed) leaves gracefully; in half the runs its entities take 6-9 s to stop, so the coordinator moves while its own shards are still handing off and the new one resumes those hand-offs from the regions' Register",
        build: |rng, cfg| {
            let nodes = 3 + rng.gen_range(0..3);
            let mut p = Params::clustered(cfg, nodes);
            leave_timeout(rng, &mut p, nodes, 0)
        },
    },
    Scenario {
        name: "cluster-crash",
        about: "clustered, a member (possibly the coordinator's) crashes; it is downed, removed, its shards move; maybe it restarts",
        build: |rng, cfg| {
            let nodes = 3 + rng.gen_range(0..3);
            let mut p = Params::clustered(cfg, nodes);
            let victim = rng.gen_range(0..nodes);
            let t = rand_time(rng, FORMED_BY_MS, FORMED_BY_MS + 3000);
            let mut script = vec![(t, Action::Crash(victim))];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 20_000, 25_000), Action::Restart(victim)));
            } else {
                p.expect_survivors = Some((0..nodes).filter(|&i| i != victim).collect());
            }
            (p, script)
        },
    },
];
