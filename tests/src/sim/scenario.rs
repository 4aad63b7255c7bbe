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
    /// The node at this slot crashes (detected and removed after a delay).
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
    /// Clustered mode: the node at this slot gets no input (a frozen
    /// process).
    Pause(usize),
    /// Clustered mode: it gets input again, its membership first.
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
    /// Crash detection delay (min, max).
    pub detect: (Duration, Duration),
    /// Node 0 also runs a proxy region (routes, hosts nothing) with a sender.
    pub proxy: bool,
    /// Membership by the real `ClusterNode` on every node (gossip, failure
    /// detection, split-brain resolver, singleton placement) instead of the
    /// script.
    pub clustered: bool,
    /// Nodes at the start when the scenario fixes it (else the config's).
    pub nodes: Option<usize>,
    /// Clustered mode: exactly these slots run at the end.
    pub expect_survivors: Option<Vec<usize>>,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

impl Params {
    fn base(cfg: &SimConfig) -> Self {
        Self {
            coordinator: CoordinatorSettings {
                min_nr_of_members: 1,
                rebalance_interval: s(2),
                handoff_timeout: s(10),
                // Warm allocation on, as the engine runs it.
                number_of_shards: cfg.shards,
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
            detect: (ms(500), ms(3000)),
            proxy: false,
            clustered: false,
            nodes: None,
            expect_survivors: None,
        }
    }

    /// Clustered mode with `nodes` nodes: the cluster forms first (the first
    /// seed's 5 s timeout and a few gossip rounds), so the load and the run
    /// are longer.
    fn clustered(cfg: &SimConfig, nodes: usize) -> Self {
        let mut p = Self::base(cfg);
        p.clustered = true;
        p.nodes = Some(nodes);
        p.rate_per_s = 25.0 * nodes as f64;
        p.workload_until = s(45);
        p.run_until = s(70);
        p.expect_survivors = Some((0..nodes).collect());
        p
    }
}

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
            (p, vec![])
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
            // 15 rounds of 2 s after the last join.
            script.push((last + s(30), Action::CheckBalanced));
            (p, script)
        },
    },
    Scenario {
        name: "leave",
        about: "a node (possibly the coordinator's) leaves gracefully under load",
        build: |rng, cfg| {
            let p = Params::base(cfg);
            let t = rand_time(rng, 3000, 10_000);
            let a = if rng.gen_bool(0.3) {
                Action::LeaveCoordinatorNode
            } else {
                Action::Leave(rng.gen_range(0..cfg.nodes))
            };
            (p, vec![(t, a)])
        },
    },
    Scenario {
        name: "crash",
        about: "a node crashes under load (detected after a delay) and later restarts",
        build: |rng, cfg| {
            let p = Params::base(cfg);
            let t = rand_time(rng, 3000, 10_000);
            let mut script = vec![(t, Action::CrashOther)];
            if rng.gen_bool(0.5) {
                script.push((t + rand_time(rng, 4000, 8000), Action::RestartCrashed));
            }
            (p, script)
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
            }
            (p, script)
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
            }
            (p, script)
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
            (p, vec![(rand_time(rng, 3000, 8000), Action::Join)])
        },
    },
    Scenario {
        name: "buffer-overflow",
        about: "the coordinator is unreachable while senders keep sending: BufferFull, then drain",
        build: |rng, cfg| {
            let mut p = Params::base(cfg);
            p.region.buffer_size = rng.gen_range(5..=30);
            let t = rand_time(rng, 0, 1000);
            let heal = t + rand_time(rng, 5000, 12_000);
            (
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
            (p, vec![(rand_time(rng, 2000, 6000), Action::Join)])
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
            (
                p,
                vec![
                    (t1, Action::Join),
                    (t2, Action::Join),
                    (t3, Action::Leave(rng.gen_range(0..cfg.nodes))),
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
            let t1 = rand_time(rng, 2000, 5000);
            let victim = rng.gen_range(1..cfg.nodes.max(2));
            let t2 = t1 + rand_time(rng, 1500, 3000);
            let t3 = t2 + rand_time(rng, 200, 4000);
            (
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
            (p, vec![])
        },
    },
    Scenario {
        name: "partition",
        about: "nodes are partitioned from each other and heal, twice",
        build: |rng, cfg| {
            let p = Params::base(cfg);
            let mut script = Vec::new();
            let mut t = rand_time(rng, 1000, 4000);
            for _ in 0..2 {
                let victim = rng.gen_range(0..cfg.nodes);
                script.push((t, Action::Partition(vec![victim])));
                t += rand_time(rng, 1000, 5000);
                script.push((t, Action::Heal));
                t += rand_time(rng, 1000, 3000);
            }
            (p, script)
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
