//! [`NodeConfig::builder`]: a node configuration written in code, with
//! `Duration`s instead of `_ms` integers and every key at the default of
//! the TOML file unless set. [`NodeConfigBuilder::build`] runs the same
//! checks as a config file ([`NodeConfig::validate`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    ClusterTableConfig, ConfigError, CoordinatorConfig, Durability, DurabilityName,
    EntityTypeConfig, HttpConfig, JournalConfig, NodeConfig, RequestsConfig,
};

/// The file name that errors of [`NodeConfigBuilder::build`] carry.
pub const BUILDER_FILE: &str = "<builder>";

/// A `Duration` as whole milliseconds (rounded down; saturating at
/// `u64::MAX`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Builds a [`NodeConfig`] in code; made by [`NodeConfig::builder`].
///
/// Every setter names the TOML key it sets; a key not set keeps the
/// default documented on that key of [`NodeConfig`] (the TOML file's
/// default). Durations are rounded down to whole milliseconds, the unit of
/// the file. Errors of [`Self::build`] name the TOML key.
///
/// ```
/// use std::time::Duration;
/// use shardline::NodeConfig;
///
/// let dir = std::env::temp_dir().join("shardline-doc-builder");
/// let config = NodeConfig::builder(
///     "127.0.0.1:7100".parse().unwrap(),
///     "127.0.0.1:7200".parse().unwrap(),
///     dir,
/// )
/// .seed_nodes(["127.0.0.1:7100".parse().unwrap()])
/// .number_of_shards(32)
/// .pin_cores(false)
/// .ask_timeout(Duration::from_secs(5))
/// .build()
/// .unwrap();
/// assert_eq!(config.requests.ask_timeout_ms, 5_000);
/// assert_eq!(config.heartbeat_pause_ms, 3_000); // the default
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct NodeConfigBuilder {
    config: NodeConfig,
}

impl NodeConfig {
    /// A builder of a node listening on `cluster_address` (node-to-node)
    /// and `client_address` (native clients), keeping its files in
    /// `data_dir`; every other key at the TOML file's default: no seeds,
    /// which [`NodeConfigBuilder::build`] refuses (set
    /// [`NodeConfigBuilder::seed_nodes`], e.g. to `[cluster_address]` for
    /// a node that forms its own cluster), no HTTP front, 1 data core,
    /// pinned cores, cluster name `"shardline"`, 100 shards, durability
    /// `"none"`, no built-in entity types, `downing_stable_after` 20 s,
    /// `heartbeat_pause` 3 s, and the defaults of the `[http]`,
    /// `[journal]`, `[requests]`, `[coordinator]` and `[cluster]` tables.
    pub fn builder(
        cluster_address: SocketAddr,
        client_address: SocketAddr,
        data_dir: impl Into<PathBuf>,
    ) -> NodeConfigBuilder {
        NodeConfigBuilder {
            config: NodeConfig {
                cluster_address,
                client_address,
                http_address: None,
                seed_nodes: Vec::new(),
                data_cores: super::default_data_cores(),
                pin_cores: super::default_true(),
                cluster_name: super::default_cluster_name(),
                data_dir: data_dir.into(),
                number_of_shards: super::default_shards(),
                durability: super::default_durability(),
                entity_types: Vec::new(),
                downing_stable_after_ms: super::default_stable_after_ms(),
                heartbeat_pause_ms: super::default_heartbeat_pause_ms(),
                http: HttpConfig::default(),
                journal: JournalConfig::default(),
                requests: RequestsConfig::default(),
                coordinator: CoordinatorConfig::default(),
                cluster: ClusterTableConfig::default(),
            },
        }
    }
}

impl NodeConfigBuilder {
    /// `seed_nodes`: the cluster addresses to join through (may include
    /// this node's own; a node whose own address is the first seed forms
    /// the cluster when no other seed answers). Required: the node joins
    /// only through its seeds, so [`Self::build`] refuses an empty list
    /// (the default).
    pub fn seed_nodes(mut self, seeds: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.config.seed_nodes = seeds.into_iter().collect();
        self
    }

    /// `http_address`: serve the HTTP/1.1 front on this address. Default:
    /// no HTTP front.
    pub fn http_address(mut self, addr: SocketAddr) -> Self {
        self.config.http_address = Some(addr);
        self
    }

    /// `data_cores`: data executors on this node (count, 1..=256).
    /// Default 1.
    pub fn data_cores(mut self, n: u16) -> Self {
        self.config.data_cores = n;
        self
    }

    /// `pin_cores`: pin executors to CPU cores when the machine has more
    /// than one. Default true.
    pub fn pin_cores(mut self, pin: bool) -> Self {
        self.config.pin_cores = pin;
        self
    }

    /// `cluster_name`: 1..=64 bytes of `A-Z a-z 0-9 . _ -`, the same on
    /// every member. Default `"shardline"`.
    pub fn cluster_name(mut self, name: impl Into<String>) -> Self {
        self.config.cluster_name = name.into();
        self
    }

    /// `number_of_shards` (count, 1..=1000000, the same on every member).
    /// Default 100.
    pub fn number_of_shards(mut self, n: u32) -> Self {
        self.config.number_of_shards = n;
        self
    }

    /// `durability`: the journal's flush policy. Default `"none"`.
    pub fn durability(mut self, d: Durability) -> Self {
        self.config.durability = d;
        self
    }

    /// `durability = "always"`: flush the journal after every batch.
    pub fn durability_always(self) -> Self {
        self.durability(Durability::Named(DurabilityName::Always))
    }

    /// `durability = { interval_ms }`: group commit every `every` (at
    /// least 1 ms).
    pub fn group_commit(self, every: Duration) -> Self {
        self.durability(Durability::Interval {
            interval_ms: millis(every),
        })
    }

    /// Adds one `[[entity_types]]` entry (a built-in kind the node starts
    /// itself). Default none.
    pub fn entity_type(mut self, t: EntityTypeConfig) -> Self {
        self.config.entity_types.push(t);
        self
    }

    /// `downing_stable_after_ms`: how long the set of unreachable members
    /// must stay unchanged before the split-brain resolver downs a side (at
    /// least 1 ms). Default 20 s.
    pub fn downing_stable_after(mut self, d: Duration) -> Self {
        self.config.downing_stable_after_ms = millis(d);
        self
    }

    /// `heartbeat_pause_ms`: the failure detector's acceptable heartbeat
    /// pause (at least 100 ms). Default 3 s.
    pub fn heartbeat_pause(mut self, d: Duration) -> Self {
        self.config.heartbeat_pause_ms = millis(d);
        self
    }

    /// `requests.ask_timeout_ms`: the ask deadline of client and
    /// embedding-API requests (100 ms..=1 h). Default 12 s.
    pub fn ask_timeout(mut self, d: Duration) -> Self {
        self.config.requests.ask_timeout_ms = millis(d);
        self
    }

    /// `requests.max_message_size_bytes`: the largest message payload, in
    /// bytes (1..=16 MiB less 1 KiB; with an HTTP front, at least
    /// `http.max_body_size_bytes`, whose default is 1 MiB). Default 16 MiB
    /// less 1 KiB.
    pub fn max_message_size_bytes(mut self, bytes: u64) -> Self {
        self.config.requests.max_message_size_bytes = bytes;
        self
    }

    /// The whole `[http]` table. Default [`HttpConfig::default`].
    pub fn http(mut self, http: HttpConfig) -> Self {
        self.config.http = http;
        self
    }

    /// The whole `[journal]` table. Default [`JournalConfig::default`]
    /// (the local journal).
    pub fn journal(mut self, journal: JournalConfig) -> Self {
        self.config.journal = journal;
        self
    }

    /// The whole `[coordinator]` table. Default
    /// [`CoordinatorConfig::default`].
    pub fn coordinator(mut self, c: CoordinatorConfig) -> Self {
        self.config.coordinator = c;
        self
    }

    /// `coordinator.rebalance_interval_ms`: time between rebalance rounds
    /// (100 ms..=1 h). Default 10 s.
    pub fn rebalance_interval(mut self, d: Duration) -> Self {
        self.config.coordinator.rebalance_interval_ms = millis(d);
        self
    }

    /// The whole `[cluster]` table. Default [`ClusterTableConfig::default`].
    pub fn cluster(mut self, c: ClusterTableConfig) -> Self {
        self.config.cluster = c;
        self
    }

    /// Checks the configuration with the checks of a config file
    /// ([`NodeConfig::validate`]) and returns it.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad TOML key (file
    /// [`BUILDER_FILE`]).
    pub fn build(self) -> Result<NodeConfig, ConfigError> {
        self.config.validate(Path::new(BUILDER_FILE))?;
        Ok(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(p: u16) -> SocketAddr {
        format!("127.0.0.1:{p}").parse().unwrap()
    }

    #[test]
    fn the_builders_defaults_are_the_files() {
        let text = "cluster_address = \"127.0.0.1:1\"\nclient_address = \"127.0.0.1:2\"\ndata_dir = \"d\"\nseed_nodes = [\"127.0.0.1:1\"]\n";
        let file = NodeConfig::from_toml(text, Path::new("x.toml")).unwrap();
        let built = NodeConfig::builder(addr(1), addr(2), "d")
            .seed_nodes([addr(1)])
            .build()
            .unwrap();
        assert_eq!(built, file);
    }

    #[test]
    fn durations_become_the_files_milliseconds() {
        let c = NodeConfig::builder(addr(1), addr(2), "d")
            .seed_nodes([addr(1)])
            .heartbeat_pause(Duration::from_millis(1500))
            .downing_stable_after(Duration::from_secs(2))
            .ask_timeout(Duration::from_millis(300))
            .group_commit(Duration::from_millis(5))
            .rebalance_interval(Duration::from_secs(1))
            .build()
            .unwrap();
        assert_eq!(c.heartbeat_pause_ms, 1500);
        assert_eq!(c.downing_stable_after_ms, 2000);
        assert_eq!(c.requests.ask_timeout(), Duration::from_millis(300));
        assert_eq!(c.durability, Durability::Interval { interval_ms: 5 });
        assert_eq!(c.coordinator.rebalance_interval_ms, 1000);
    }

    #[test]
    fn build_refuses_what_the_file_refuses_naming_the_key() {
        let b = || NodeConfig::builder(addr(1), addr(2), "d").seed_nodes([addr(1)]);
        for (r, key) in [
            (b().data_cores(0).build(), "data_cores"),
            (
                b().heartbeat_pause(Duration::from_millis(99)).build(),
                "heartbeat_pause_ms",
            ),
            (
                b().ask_timeout(Duration::from_millis(5)).build(),
                "requests.ask_timeout_ms",
            ),
            (
                b().group_commit(Duration::from_micros(10)).build(),
                "durability.interval_ms",
            ),
            (b().cluster_name("a b").build(), "cluster_name"),
            (
                NodeConfig::builder(addr(1), addr(1), "d")
                    .seed_nodes([addr(1)])
                    .build(),
                "client_address",
            ),
            // The default: no seeds, so the node would never join.
            (
                NodeConfig::builder(addr(1), addr(2), "d").build(),
                "seed_nodes",
            ),
        ] {
            let e = r.unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(key) && msg.contains(BUILDER_FILE),
                "{key}: {msg}"
            );
        }
    }

    #[test]
    fn a_small_message_limit_without_an_http_front_builds() {
        let c = NodeConfig::builder(addr(1), addr(2), "d")
            .seed_nodes([addr(1)])
            .max_message_size_bytes(1024)
            .build()
            .expect("no HTTP front: its body limit bounds nothing");
        assert_eq!(c.requests.max_message_size_bytes, 1024);
        // With an HTTP front the default 1 MiB body limit exceeds it...
        let e = NodeConfig::builder(addr(1), addr(2), "d")
            .seed_nodes([addr(1)])
            .http_address(addr(3))
            .max_message_size_bytes(1024)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("http.max_body_size_bytes"), "{e}");
        // ... and one within it builds.
        let c = NodeConfig::builder(addr(1), addr(2), "d")
            .seed_nodes([addr(1)])
            .http_address(addr(3))
            .max_message_size_bytes(1024)
            .http(HttpConfig {
                max_body_size_bytes: 1024,
                ..HttpConfig::default()
            })
            .build()
            .expect("body limit within the message limit");
        assert_eq!(c.http.max_body_size_bytes, 1024);
    }
}
