//! Workloads: which entity each request goes to and what it asks.
//!
//! Entities are numbered `0..N` (or by trace page number) and named by their
//! decimal number. Entities are partitioned across the harness's
//! connections by `entity % connections`, so all requests to one entity go
//! over one connection in the order generated (per-entity order is kept, and
//! each entity's outcomes are observed by exactly one connection).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::trace::TraceReader;

/// Entity type name of the built-in echo entity.
pub const ECHO_TYPE: &str = "echo";
/// Entity type name of the built-in counter entity.
pub const COUNTER_TYPE: &str = "counter";
/// Payload sent to echo entities (16 bytes).
pub const ECHO_PAYLOAD: &[u8] = b"shardline-bench!";

/// One kind of request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    /// `echo` entity, payload [`ECHO_PAYLOAD`].
    Echo,
    /// `counter` entity, payload `add 1`.
    CounterAdd,
    /// `counter` entity, payload `get`.
    CounterGet,
}

impl OpKind {
    /// The entity type this request addresses.
    pub fn type_name(self) -> &'static str {
        match self {
            OpKind::Echo => ECHO_TYPE,
            OpKind::CounterAdd | OpKind::CounterGet => COUNTER_TYPE,
        }
    }

    /// The request payload (ASCII, see the counter protocol in docs/interfaces.md).
    pub fn payload(self) -> &'static [u8] {
        match self {
            OpKind::Echo => ECHO_PAYLOAD,
            OpKind::CounterAdd => b"add 1",
            OpKind::CounterGet => b"get",
        }
    }
}

/// A weighted choice of request kinds, parsed from `--op`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpMix {
    /// Kinds with their integer weights (> 0).
    pub weights: Vec<(OpKind, u32)>,
}

impl OpMix {
    /// Parses `echo`, `counter-add`, `counter-get` or
    /// `mix:KIND=WEIGHT,...` where KIND is `echo`, `add` or `get`
    /// (e.g. `mix:add=90,get=10`).
    ///
    /// # Errors
    /// An unknown kind, a missing or non-integer weight, or all weights zero.
    pub fn parse(text: &str) -> Result<OpMix, String> {
        let single = |kind| OpMix {
            weights: vec![(kind, 1)],
        };
        match text {
            "echo" => return Ok(single(OpKind::Echo)),
            "counter-add" | "add" => return Ok(single(OpKind::CounterAdd)),
            "counter-get" | "get" => return Ok(single(OpKind::CounterGet)),
            _ => {}
        }
        let Some(spec) = text.strip_prefix("mix:") else {
            return Err(format!(
                "unknown op `{text}` (use echo, counter-add, counter-get or mix:add=90,get=10)"
            ));
        };
        let mut weights = Vec::new();
        for part in spec.split(',') {
            let (name, weight) = part
                .split_once('=')
                .ok_or_else(|| format!("mix entry `{part}` is not KIND=WEIGHT"))?;
            let kind = match name.trim() {
                "echo" => OpKind::Echo,
                "add" | "counter-add" => OpKind::CounterAdd,
                "get" | "counter-get" => OpKind::CounterGet,
                other => return Err(format!("unknown op `{other}` in mix (use echo, add, get)")),
            };
            let weight: u32 = weight
                .trim()
                .parse()
                .map_err(|_| format!("weight `{weight}` of `{name}` is not an unsigned integer"))?;
            if weight > 0 {
                weights.push((kind, weight));
            }
        }
        if weights.is_empty() {
            return Err(format!("mix `{text}` has no positive weight"));
        }
        Ok(OpMix { weights })
    }

    /// Whether any request of this mix adds to a counter.
    pub fn has_adds(&self) -> bool {
        self.weights.iter().any(|(k, _)| *k == OpKind::CounterAdd)
    }

    /// Picks one kind with probability proportional to its weight.
    pub fn pick(&self, rng: &mut ChaCha8Rng) -> OpKind {
        if self.weights.len() == 1 {
            return self.weights[0].0;
        }
        let total: u32 = self.weights.iter().map(|(_, w)| w).sum();
        let mut x = rng.gen_range(0..total);
        for (kind, weight) in &self.weights {
            if x < *weight {
                return *kind;
            }
            x -= weight;
        }
        self.weights[self.weights.len() - 1].0
    }
}

/// Key distribution over `--entities N`, parsed from `--dist`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyDist {
    /// Every entity equally likely.
    Uniform,
    /// Zipf with exponent `s`: entity `k` (0-based) has weight `1/(k+1)^s`.
    Zipf(f64),
}

impl KeyDist {
    /// Parses `uniform` or `zipf:S` with `S >= 0`.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(text: &str) -> Result<KeyDist, String> {
        if text == "uniform" {
            return Ok(KeyDist::Uniform);
        }
        if let Some(s) = text.strip_prefix("zipf:") {
            let s: f64 = s
                .parse()
                .map_err(|_| format!("zipf exponent `{s}` is not a number"))?;
            if !(s.is_finite() && s >= 0.0) {
                return Err(format!("zipf exponent {s} must be >= 0"));
            }
            return Ok(KeyDist::Zipf(s));
        }
        Err(format!(
            "unknown distribution `{text}` (use uniform or zipf:S)"
        ))
    }
}

/// One request to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Entity number; its id on the wire is the decimal string.
    pub entity: u64,
    /// What to ask.
    pub op: OpKind,
}

/// What the requests are drawn from.
#[derive(Clone, Debug, Serialize)]
pub enum Workload {
    /// Synthetic keys over `0..entities`.
    Synthetic {
        /// Number of entities (count, >= 1).
        entities: u64,
        /// Key distribution.
        dist: KeyDist,
    },
    /// Page references of an ARC trace, in order.
    Trace {
        /// The `.lis` or `.lis.zst` file.
        path: PathBuf,
    },
}

/// Cumulative Zipf weights of the entities `c, c + n, c + 2n, …` below
/// `entities` (one partition), plus their sum relative to all entities.
struct ZipfPartition {
    cumulative: Vec<f64>,
    mass: f64,
}

fn zipf_partition(entities: u64, s: f64, partition: u64, partitions: u64) -> ZipfPartition {
    let mut cumulative = Vec::with_capacity((entities / partitions + 1) as usize);
    let mut total = 0.0f64;
    let mut mine = 0.0f64;
    for k in 0..entities {
        let w = 1.0 / ((k + 1) as f64).powf(s);
        total += w;
        if k % partitions == partition {
            mine += w;
            cumulative.push(mine);
        }
    }
    ZipfPartition {
        cumulative,
        mass: if total > 0.0 { mine / total } else { 0.0 },
    }
}

/// Share (0..=1) of all requests that fall into partition `partition` of
/// `partitions` for a synthetic workload: the open-loop rate of that
/// connection is this share of the total rate, so the aggregate follows the
/// distribution exactly. For a trace this says `1/partitions`; its true
/// shares need a pass over the file ([`partition_shares`]).
pub fn partition_share(workload: &Workload, partition: u64, partitions: u64) -> f64 {
    match workload {
        Workload::Synthetic {
            entities,
            dist: KeyDist::Uniform,
        } => partition_size(*entities, partition, partitions) as f64 / *entities as f64,
        Workload::Synthetic {
            entities,
            dist: KeyDist::Zipf(s),
        } => zipf_partition(*entities, *s, partition, partitions).mass,
        Workload::Trace { .. } => 1.0 / partitions as f64,
    }
}

/// The share (0..=1) of each of `partitions` partitions: as
/// [`partition_share`] for a synthetic workload; for a trace, the
/// fraction of its references whose page falls into the partition
/// (`page % partitions`), counted in one pass over the file. Rates and
/// request quotas split by these shares make every connection replay its
/// part over the same time, so the aggregate rate holds to the end (an
/// even split left the connections with fewer references idle while the
/// others still ran, and the last seconds at a fraction of the rate).
///
/// # Errors
/// When the trace cannot be read or has a malformed line.
pub fn partition_shares(workload: &Workload, partitions: u64) -> Result<Vec<f64>> {
    let Workload::Trace { path } = workload else {
        return Ok((0..partitions)
            .map(|p| partition_share(workload, p, partitions))
            .collect());
    };
    let mut counts = vec![0u64; partitions as usize];
    for page in TraceReader::open(path)? {
        counts[(page? % partitions) as usize] += 1;
    }
    let total: u64 = counts.iter().sum();
    Ok(counts
        .iter()
        .map(|&c| {
            if total == 0 {
                1.0 / partitions as f64
            } else {
                c as f64 / total as f64
            }
        })
        .collect())
}

/// Splits `total` requests between partitions in proportion to `shares`
/// (largest remainder: the parts sum to `total` exactly, and equal shares
/// give parts that differ by at most one).
pub fn split_by_shares(total: u64, shares: &[f64]) -> Vec<u64> {
    let sum: f64 = shares.iter().sum();
    if shares.is_empty() {
        return Vec::new();
    }
    if sum <= 0.0 {
        let n = shares.len() as u64;
        return (0..n)
            .map(|c| total / n + u64::from(c < total % n))
            .collect();
    }
    let exact: Vec<f64> = shares.iter().map(|s| total as f64 * s / sum).collect();
    let mut parts: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
    let given: u64 = parts.iter().sum();
    let mut order: Vec<usize> = (0..shares.len()).collect();
    // Largest fractional part first; ties to the lower partition.
    order.sort_by(|&a, &b| {
        let fa = exact[a] - exact[a].floor();
        let fb = exact[b] - exact[b].floor();
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    for &i in order
        .iter()
        .cycle()
        .take(total.saturating_sub(given) as usize)
    {
        parts[i] += 1;
    }
    parts
}

/// Number of entities `e < entities` with `e % partitions == partition`.
pub fn partition_size(entities: u64, partition: u64, partitions: u64) -> u64 {
    if partition >= entities {
        0
    } else {
        (entities - partition).div_ceil(partitions)
    }
}

enum Keys {
    Uniform {
        partition: u64,
        partitions: u64,
        size: u64,
    },
    Zipf {
        partition: u64,
        partitions: u64,
        cumulative: Vec<f64>,
    },
    Trace {
        reader: TraceReader,
        partitions: u64,
        partition: u64,
    },
}

/// The request stream of one connection (its partition of the entities).
pub struct RequestSource {
    keys: Keys,
    ops: OpMix,
    rng: ChaCha8Rng,
}

impl RequestSource {
    /// Builds the stream of partition `partition` of `partitions`, seeded
    /// with `seed` (the same seed gives the same stream).
    ///
    /// # Errors
    /// When the trace cannot be opened, or the partition holds no entity.
    pub fn new(
        workload: &Workload,
        ops: &OpMix,
        seed: u64,
        partition: u64,
        partitions: u64,
    ) -> Result<RequestSource> {
        use rand::SeedableRng;
        let keys = match workload {
            Workload::Synthetic { entities, dist } => {
                let size = partition_size(*entities, partition, partitions);
                if size == 0 {
                    bail!("{entities} entities leave connection {partition} of {partitions} without any; use fewer connections");
                }
                match dist {
                    KeyDist::Uniform => Keys::Uniform {
                        partition,
                        partitions,
                        size,
                    },
                    KeyDist::Zipf(s) => Keys::Zipf {
                        partition,
                        partitions,
                        cumulative: zipf_partition(*entities, *s, partition, partitions).cumulative,
                    },
                }
            }
            Workload::Trace { path } => Keys::Trace {
                reader: TraceReader::open(path)
                    .with_context(|| format!("connection {partition}"))?,
                partitions,
                partition,
            },
        };
        let rng = ChaCha8Rng::seed_from_u64(seed ^ partition.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Ok(RequestSource {
            keys,
            ops: ops.clone(),
            rng,
        })
    }
}

impl Iterator for RequestSource {
    type Item = Result<Request>;

    fn next(&mut self) -> Option<Result<Request>> {
        let entity = match &mut self.keys {
            Keys::Uniform {
                partition,
                partitions,
                size,
            } => *partition + self.rng.gen_range(0..*size) * *partitions,
            Keys::Zipf {
                partition,
                partitions,
                cumulative,
            } => {
                let total = *cumulative.last()?;
                let u = self.rng.gen::<f64>() * total;
                let index = cumulative
                    .partition_point(|&c| c <= u)
                    .min(cumulative.len() - 1);
                *partition + index as u64 * *partitions
            }
            Keys::Trace {
                reader,
                partitions,
                partition,
            } => loop {
                match reader.next()? {
                    Ok(page) if page % *partitions == *partition => break page,
                    Ok(_) => continue,
                    Err(error) => return Some(Err(error)),
                }
            },
        };
        let op = self.ops.pick(&mut self.rng);
        Some(Ok(Request { entity, op }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(entities: u64, dist: KeyDist) -> Workload {
        Workload::Synthetic { entities, dist }
    }

    #[test]
    fn op_mix_parses_and_weights() {
        assert_eq!(
            OpMix::parse("echo").unwrap().weights,
            vec![(OpKind::Echo, 1)]
        );
        let mix = OpMix::parse("mix:add=3,get=1,echo=0").unwrap();
        assert_eq!(
            mix.weights,
            vec![(OpKind::CounterAdd, 3), (OpKind::CounterGet, 1)]
        );
        assert!(mix.has_adds());
        assert!(OpMix::parse("mix:add=x").is_err());
        assert!(OpMix::parse("mix:put=1").is_err());
        assert!(OpMix::parse("mix:add=0").is_err());
        assert!(OpMix::parse("delete").is_err());
        use rand::SeedableRng;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let adds = (0..40_000)
            .filter(|_| mix.pick(&mut rng) == OpKind::CounterAdd)
            .count();
        assert!(
            (29_000..31_000).contains(&adds),
            "{adds} adds of 40000 with weight 3:1"
        );
    }

    #[test]
    fn dist_parses() {
        assert_eq!(KeyDist::parse("uniform").unwrap(), KeyDist::Uniform);
        assert_eq!(KeyDist::parse("zipf:0.99").unwrap(), KeyDist::Zipf(0.99));
        assert!(KeyDist::parse("zipf:-1").is_err());
        assert!(KeyDist::parse("normal").is_err());
    }

    #[test]
    fn uniform_stays_in_its_partition_and_covers_it() {
        let w = synthetic(10, KeyDist::Uniform);
        let ops = OpMix::parse("echo").unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for r in RequestSource::new(&w, &ops, 1, 1, 3).unwrap().take(2000) {
            seen.insert(r.unwrap().entity);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 4, 7]);
        assert_eq!(partition_size(10, 0, 3), 4);
        assert_eq!(partition_size(10, 2, 3), 3);
        assert_eq!(partition_size(2, 2, 3), 0);
        assert!(RequestSource::new(&synthetic(2, KeyDist::Uniform), &ops, 1, 2, 3).is_err());
    }

    #[test]
    fn zipf_frequencies_follow_the_law() {
        // s = 1 over 100 entities, one partition: P(0)/P(1) = 2, P(0)/P(9) = 10.
        let w = synthetic(100, KeyDist::Zipf(1.0));
        let ops = OpMix::parse("echo").unwrap();
        let mut counts = [0u32; 100];
        for r in RequestSource::new(&w, &ops, 9, 0, 1).unwrap().take(200_000) {
            counts[r.unwrap().entity as usize] += 1;
        }
        let h100: f64 = (1..=100).map(|k| 1.0 / k as f64).sum();
        let expected0 = 200_000.0 / h100;
        assert!(
            (counts[0] as f64 - expected0).abs() < expected0 * 0.03,
            "{} vs {expected0}",
            counts[0]
        );
        let ratio = counts[0] as f64 / counts[9] as f64;
        assert!((8.5..11.5).contains(&ratio), "ratio {ratio}");
    }

    #[test]
    fn zipf_partition_shares_sum_to_one() {
        let w = synthetic(1000, KeyDist::Zipf(0.99));
        let total: f64 = (0..4).map(|p| partition_share(&w, p, 4)).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(partition_share(&w, 0, 4) > partition_share(&w, 3, 4));
        let u = synthetic(10, KeyDist::Uniform);
        assert!((partition_share(&u, 0, 3) - 0.4).abs() < 1e-12);
    }

    #[test]
    fn a_traces_shares_are_its_references_per_partition() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.lis");
        // References to pages 3, 4, 5, 6, 7 (the line `6 2 ...` is two
        // pages), 9 and 12: by page % 3, partition 0 has 3, 6, 9, 12,
        // partition 1 has 4, 7 and partition 2 has 5.
        std::fs::write(
            &path,
            "3 1 0 0\n4 1 0 1\n5 1 0 2\n6 2 0 3\n9 1 0 4\n12 1 0 5\n",
        )
        .unwrap();
        let shares = partition_shares(&Workload::Trace { path }, 3).unwrap();
        for (share, expected) in shares.iter().zip([4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0]) {
            assert!((share - expected).abs() < 1e-12, "{shares:?}");
        }
        let synthetic = partition_shares(&synthetic(10, KeyDist::Uniform), 3).unwrap();
        assert!((synthetic[0] - 0.4).abs() < 1e-12);
    }

    #[test]
    fn quotas_split_by_shares_sum_to_the_total() {
        assert_eq!(split_by_shares(10, &[0.5, 0.3, 0.2]), vec![5, 3, 2]);
        assert_eq!(split_by_shares(10, &[1.0, 1.0, 1.0]), vec![4, 3, 3]);
        assert_eq!(split_by_shares(7, &[0.0, 0.0]), vec![4, 3]);
        let parts = split_by_shares(1_000_003, &[0.61, 0.27, 0.12]);
        assert_eq!(parts.iter().sum::<u64>(), 1_000_003);
        assert_eq!(parts[1], 270_001, "{parts:?}");
        assert!(split_by_shares(5, &[]).is_empty());
    }

    #[test]
    fn trace_partitions_keep_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.lis");
        std::fs::write(&path, "4 1 0 0\n1 1 0 1\n6 2 0 2\n3 1 0 3\n").unwrap();
        let w = Workload::Trace { path };
        let ops = OpMix::parse("counter-add").unwrap();
        let even: Vec<u64> = RequestSource::new(&w, &ops, 1, 0, 2)
            .unwrap()
            .map(|r| r.unwrap().entity)
            .collect();
        let odd: Vec<u64> = RequestSource::new(&w, &ops, 1, 1, 2)
            .unwrap()
            .map(|r| r.unwrap().entity)
            .collect();
        assert_eq!(even, vec![4, 6]);
        assert_eq!(odd, vec![1, 7, 3]);
    }
}
