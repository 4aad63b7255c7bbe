//! The HTTP/1.1 front: entity requests for load balancers and ordinary
//! clients, the admin API, health checks and Prometheus metrics.
//!
//! ```text
//! socket bytes ─► codec::RequestDecoder ─► Request ─► dispatch() ─┬─► Action::Ask ─► region (same path as the native protocol)
//!                      │ 400/411/413/431                          ├─► Action::Admin ─► node status ─► JSON / text
//!                      ▼                                          └─► Action::Respond (404, 405, 400, ...)
//!               error response + close          responses ─► response::ResponseQueue (request order) ─► socket
//! ```
//!
//! Everything in this module but the connection task is sans-IO and tested
//! without sockets: the decoder ([`codec`]), the router ([`route`](mod@route)), the
//! response encoder and the native-status mapping ([`response`]), and the
//! Prometheus writer ([`metrics`]).
//!
//! Entity bodies of the built-in types (`POST /v1/entities/{type}/{id}`):
//! - `echo`: any bytes; the reply body is the same bytes.
//! - `counter`: `add <n>` (n an i64 in decimal) answers the new value in
//!   ASCII decimal; `get` answers the current value. An unparsable command
//!   is answered `200` with `error: <reason>` (the entity keeps its state).
//!
//! Example: `curl -d 'add 5' http://127.0.0.1:7301/v1/entities/counter/a`.

pub mod codec;
pub mod metrics;
pub mod response;
pub mod route;
pub(crate) mod serve;

use serde::Serialize;
use shardline_core::ids::{EntityId, TypeName};
use shardline_core::sharding::shard_id_of;

use crate::status::NodeStatus;
use crate::status::{ClusterShardingStats, FailedMember, MemberShardStats, RegionShardStats};
pub use codec::{CodecLimits, HttpError, Method, Pending, Request, RequestDecoder};
pub use metrics::{write_prometheus, MetricsSnapshot};
pub use response::{status_code_of, Response, ResponseQueue};
pub use route::{route, Route, RouteError};

/// What the connection does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Answer at once.
    Respond(Response),
    /// Ask the entity; answer with [`Response::from_status`].
    Ask {
        /// The entity type.
        type_name: TypeName,
        /// The entity id.
        entity_id: EntityId,
        /// The message (the request body).
        payload: Vec<u8>,
    },
    /// An admin or health route that needs the node's state.
    Admin(Route),
}

/// Routes one decoded request.
pub fn dispatch(req: Request) -> Action {
    match route::route(req.method, &req.target) {
        Ok(Route::Entity {
            type_name,
            entity_id,
        }) => Action::Ask {
            type_name,
            entity_id,
            payload: req.body,
        },
        Ok(r) => Action::Admin(r),
        Err(e) => {
            let mut resp = Response::text(e.status_code(), e.to_string());
            if let RouteError::MethodNotAllowed { allow } = e {
                resp.allow = Some(allow);
            }
            Action::Respond(resp)
        }
    }
}

/// The response for a decoder error (the connection closes after it).
pub fn error_response(e: &HttpError) -> Response {
    Response::text(e.status_code(), e.to_string())
}

/// Whether the node is ready to route: its member is Up, every region on
/// this node is registered with the coordinator, and every core's journal
/// opened (`/health/ready`).
pub fn is_ready(status: &NodeStatus) -> bool {
    let me_up = status
        .members
        .iter()
        .any(|m| m.address == status.address && m.uid == status.uid && m.status == "Up");
    me_up
        && status.coordinator.is_some()
        && !status.regions.is_empty()
        && status.regions.iter().all(|r| r.registered)
        && status.regions.iter().all(|r| r.journal_error.is_none())
}

#[derive(Serialize)]
struct MemberJson<'a> {
    address: &'a str,
    #[serde(serialize_with = "crate::status::uid_string::serialize")]
    uid: u64,
    status: &'a str,
    roles: Vec<String>,
    reachable: bool,
    leader: bool,
    oldest: bool,
}

#[derive(Serialize)]
struct MembersJson<'a> {
    self_address: &'a str,
    leader: Option<&'a str>,
    oldest: Option<&'a str>,
    members: Vec<MemberJson<'a>>,
}

#[derive(Serialize)]
struct RegionStatsJson<'a> {
    core: u16,
    proxy: bool,
    registered: bool,
    /// Hosted shards (count).
    shard_count: usize,
    /// Live entities in all its shards (count).
    entities: u64,
    /// Shard id → live entities.
    shards: &'a std::collections::BTreeMap<u32, u32>,
    buffered: u64,
    dead_letters: u64,
}

#[derive(Serialize)]
struct MemberStatsJson<'a> {
    address: &'a str,
    #[serde(serialize_with = "crate::status::uid_string::serialize")]
    uid: u64,
    regions: Vec<RegionStatsJson<'a>>,
}

#[derive(Serialize)]
struct StatsJson<'a> {
    type_name: &'a str,
    /// Shards hosted by the members that answered (count).
    total_shards: usize,
    /// Live entities on the members that answered (count).
    total_entities: u64,
    members: Vec<MemberStatsJson<'a>>,
    failed: Vec<FailedJson<'a>>,
}

#[derive(Serialize)]
struct FailedJson<'a> {
    address: &'a str,
    #[serde(serialize_with = "crate::status::uid_string::serialize")]
    uid: u64,
    reason: &'a str,
}

#[derive(Serialize)]
struct RegionStateJson<'a> {
    node: &'a str,
    core: u16,
    registered: bool,
    shards: &'a std::collections::BTreeMap<u32, Vec<String>>,
}

#[derive(Serialize)]
struct ShardOfJson<'a> {
    entity_id: &'a str,
    number_of_shards: u32,
    shard: u32,
    hash: &'static str,
    /// The first of `homes` (kept for clients of the single-type form).
    home: Option<HomeJson<'a>>,
    /// The shard's home for every entity type whose home this node knows:
    /// hosted here, or cached by this core's region from the coordinator.
    homes: Vec<HomeJson<'a>>,
}

#[derive(Serialize, Clone)]
struct HomeJson<'a> {
    type_name: &'a str,
    node: &'a str,
    core: u16,
}

/// A shard home this node's region learned from the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CachedHome {
    /// The entity type whose region cached the home.
    pub type_name: String,
    /// The cluster address (`host:port`) of the member that hosts the shard.
    pub node: String,
    /// The data core (index) of that member whose region hosts the shard.
    pub core: u16,
}

/// `GET /v1/sharding/shard-of/{id}[?shards=N]`: the shard of `entity_id`
/// (xxh3-64 seed 0 modulo N, N = `number_of_shards` when not given) and,
/// when N is the node's own, the shard's home per entity type: a region of
/// this node that hosts it, else the home this core's region has cached
/// (`cached`, from the coordinator's `ShardHome` answers); a type whose home
/// is not known here (never asked, or being moved) is left out.
pub fn shard_of_response(
    entity_id: &EntityId,
    shards: Option<u32>,
    number_of_shards: u32,
    status: &NodeStatus,
    cached: &[CachedHome],
) -> Response {
    let n = shards.unwrap_or(number_of_shards).max(1);
    let shard = shard_id_of(entity_id.as_str(), n).0;
    let mut homes: Vec<HomeJson<'_>> = Vec::new();
    if n == number_of_shards {
        for r in status
            .regions
            .iter()
            .filter(|r| r.shards.contains_key(&shard))
        {
            if !homes.iter().any(|h| h.type_name == r.type_name) {
                homes.push(HomeJson {
                    type_name: &r.type_name,
                    node: &status.address,
                    core: r.core,
                });
            }
        }
        for c in cached {
            if !homes.iter().any(|h| h.type_name == c.type_name) {
                homes.push(HomeJson {
                    type_name: &c.type_name,
                    node: &c.node,
                    core: c.core,
                });
            }
        }
    }
    json(&ShardOfJson {
        entity_id: entity_id.as_str(),
        number_of_shards: n,
        shard,
        hash: "xxh3-64 seed 0 modulo number_of_shards",
        home: homes.first().cloned(),
        homes,
    })
}

fn json<T: Serialize>(v: &T) -> Response {
    match serde_json::to_vec_pretty(v) {
        Ok(mut b) => {
            b.push(b'\n');
            Response::json(200, b)
        }
        Err(e) => Response::text(500, format!("cannot encode JSON: {e}")),
    }
}

/// Answers an admin route from this node's status. `number_of_shards` is
/// the node's configured value (used by shard-of without `shards=`);
/// `metrics` renders `/metrics` (called only for that route).
///
/// The member list is this node's view: the `oldest` member is the one the
/// coordinator runs on (Akka: the coordinator singleton lives on the oldest
/// member); roles are not configured in this release, so they are empty.
pub fn admin_response(
    route: &Route,
    status: &NodeStatus,
    number_of_shards: u32,
    metrics: impl FnOnce() -> MetricsSnapshot,
) -> Response {
    match route {
        Route::Live => Response::text(200, "live"),
        Route::Ready => {
            if is_ready(status) {
                Response::text(200, "ready")
            } else {
                let why = match status.regions.iter().find_map(|r| {
                    r.journal_error.as_ref().map(|e| {
                        if e.starts_with("journal ") {
                            format!("not ready: core {}: {e}", r.core)
                        } else {
                            format!(
                                "not ready: the journal of core {} did not open: {e}",
                                r.core
                            )
                        }
                    })
                }) {
                    Some(why) => why,
                    None => {
                        "not ready: the member is not Up, its regions are not registered, or they do not \
                         know every shard's home yet"
                            .into()
                    }
                };
                let mut r = Response::text(503, why);
                r.retry_after = true;
                r
            }
        }
        Route::Members => {
            let members = status
                .members
                .iter()
                .map(|m| MemberJson {
                    address: &m.address,
                    uid: m.uid,
                    status: &m.status,
                    roles: Vec::new(),
                    reachable: m.reachable,
                    leader: status.leader.as_deref() == Some(m.address.as_str()),
                    oldest: status.coordinator.as_deref() == Some(m.address.as_str()),
                })
                .collect();
            json(&MembersJson {
                self_address: &status.address,
                leader: status.leader.as_deref(),
                oldest: status.coordinator.as_deref(),
                members,
            })
        }
        Route::ShardingStats { type_name } => {
            // This node only; the connection task gathers the other
            // members' regions and calls `sharding_stats_response` itself.
            if !status
                .regions
                .iter()
                .any(|r| r.type_name == type_name.as_str())
            {
                return unknown_type(type_name);
            }
            let local = ClusterShardingStats {
                members: vec![MemberShardStats {
                    address: status.address.clone(),
                    uid: status.uid,
                    regions: status
                        .regions
                        .iter()
                        .filter(|r| r.type_name == type_name.as_str())
                        .map(RegionShardStats::of)
                        .collect(),
                }],
                failed: Vec::new(),
            };
            sharding_stats_response(type_name, &local)
        }
        Route::Region { type_name } => {
            let regions: Vec<_> = status
                .regions
                .iter()
                .filter(|r| r.type_name == type_name.as_str())
                .map(|r| RegionStateJson {
                    node: &status.address,
                    core: r.core,
                    registered: r.registered,
                    shards: &r.shards,
                })
                .collect();
            if regions.is_empty() {
                return unknown_type(type_name);
            }
            json(&regions)
        }
        Route::ShardOf { entity_id, shards } => {
            shard_of_response(entity_id, *shards, number_of_shards, status, &[])
        }
        Route::Metrics => {
            let mut m = metrics();
            m.ready = is_ready(status);
            Response::new(
                200,
                response::PROMETHEUS_TEXT,
                write_prometheus(&m).into_bytes(),
            )
        }
        Route::Entity { .. } => Response::text(500, "entity route reached the admin handler"),
        Route::Allocation | Route::Rebalance { .. } => {
            Response::text(500, "coordinator route reached the node-status handler")
        }
    }
}

/// `GET /v1/sharding/{type}/stats` from gathered stats: every member that
/// answered with its regions (shard → live entities) and the totals, and
/// the members that did not answer under `failed` with the reason (Akka's
/// `ClusterShardingStats`).
pub fn sharding_stats_response(type_name: &TypeName, stats: &ClusterShardingStats) -> Response {
    let members: Vec<MemberStatsJson<'_>> = stats
        .members
        .iter()
        .map(|m| MemberStatsJson {
            address: &m.address,
            uid: m.uid,
            regions: m
                .regions
                .iter()
                .map(|r| RegionStatsJson {
                    core: r.core,
                    proxy: r.proxy,
                    registered: r.registered,
                    shard_count: r.shards.len(),
                    entities: r.shards.values().map(|n| u64::from(*n)).sum(),
                    shards: &r.shards,
                    buffered: r.buffered,
                    dead_letters: r.dead_letters,
                })
                .collect(),
        })
        .collect();
    let regions = || members.iter().flat_map(|m| m.regions.iter());
    json(&StatsJson {
        type_name: type_name.as_str(),
        total_shards: regions().map(|r| r.shard_count).sum(),
        total_entities: regions().map(|r| r.entities).sum(),
        failed: stats
            .failed
            .iter()
            .map(|f: &FailedMember| FailedJson {
                address: &f.address,
                uid: f.uid,
                reason: &f.reason,
            })
            .collect(),
        members,
    })
}

/// The response to a coordinator admin route (`/v1/coordinator/...`):
/// `200` with the JSON, else the status's code (`503` with `Retry-After`
/// when no coordinator runs or its member did not answer, `404` for a type
/// without a coordinator) and the reason.
pub fn coordinator_admin_response(
    answer: Result<Vec<u8>, (crate::envelope::Status, String)>,
) -> Response {
    match answer {
        Ok(mut json) => {
            json.push(b'\n');
            Response::json(200, json)
        }
        Err((st, why)) => {
            let code = status_code_of(st);
            let mut r = Response::text(code, why);
            r.retry_after = code == 503;
            r
        }
    }
}

fn unknown_type(t: &TypeName) -> Response {
    Response::text(
        404,
        format!(
            "no region of entity type `{}` on this node",
            t.as_str().escape_debug()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{MemberStatusView, RegionStatusView};

    fn status(up: bool, registered: bool) -> NodeStatus {
        NodeStatus {
            address: "127.0.0.1:7101".into(),
            uid: 7,
            client_address: "127.0.0.1:7201".into(),
            members: vec![
                MemberStatusView {
                    address: "127.0.0.1:7101".into(),
                    uid: 7,
                    status: if up { "Up" } else { "Joining" }.into(),
                    reachable: true,
                },
                MemberStatusView {
                    address: "127.0.0.1:7102".into(),
                    uid: 9,
                    status: "Up".into(),
                    reachable: false,
                },
            ],
            leader: Some("127.0.0.1:7101".into()),
            coordinator: Some("127.0.0.1:7102".into()),
            coordinator_here: false,
            regions: vec![RegionStatusView {
                type_name: "counter".into(),
                core: 0,
                proxy: false,
                registered,
                homes_known: 16,
                shards: [(3u32, vec!["a".to_string()])].into_iter().collect(),
                entities: 1,
                messages_delivered: 5,
                entities_activated: 1,
                dead_letters: 0,
                dead_letter_reasons: Default::default(),
                journal_error: None,
                buffered: 0,
                worker: None,
                hand_offs_begun: 0,
                hand_offs_completed: 0,
            }],
            coordinators: Vec::new(),
            cluster_name: "shardline".into(),
            cluster_id: None,
            journal_identity: String::new(),
        }
    }

    fn body(r: &Response) -> String {
        String::from_utf8(r.body.clone()).unwrap()
    }

    #[test]
    fn shard_of_names_the_home_per_type_hosted_here_or_cached_from_the_coordinator() {
        let st = status(true, true); // hosts shard 3 of `counter` on core 0
        let id = (0..10_000)
            .map(|i| EntityId::new(format!("e{i}")).unwrap())
            .find(|e| shard_id_of(e.as_str(), 100).0 == 3)
            .unwrap();
        let home = |t: &str, node: &str, core| CachedHome {
            type_name: t.to_string(),
            node: node.to_string(),
            core,
        };
        let cached = vec![
            home("counter", "127.0.0.1:7102", 1),
            home("other", "127.0.0.1:7103", 0),
        ];
        let r = shard_of_response(&id, None, 100, &st, &cached);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["shard"], 3);
        // Hosted here wins over the cache for `counter`; `other` is cached.
        assert_eq!(v["homes"][0]["type_name"], "counter");
        assert_eq!(v["homes"][0]["node"], st.address.as_str());
        assert_eq!(v["homes"][1]["type_name"], "other");
        assert_eq!(v["homes"][1]["node"], "127.0.0.1:7103");
        assert_eq!(v["home"], v["homes"][0]);
        // Another number of shards: no home is claimed.
        let r = shard_of_response(&id, Some(7), 100, &st, &cached);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["homes"].as_array().map(Vec::len), Some(0));
        assert!(v["home"].is_null());
    }

    #[test]
    fn a_journal_that_did_not_open_makes_the_node_not_ready_and_says_why() {
        let mut st = status(true, true);
        st.regions[0].journal_error = Some("segment 1: record checksum mismatch".into());
        assert!(!is_ready(&st));
        let r = admin_response(&Route::Ready, &st, 100, MetricsSnapshot::default);
        assert_eq!(r.code, 503);
        assert!(r.retry_after);
        assert!(
            body(&r)
                .contains("journal of core 0 did not open: segment 1: record checksum mismatch"),
            "{}",
            body(&r)
        );
    }

    #[test]
    fn readiness_needs_up_and_registered() {
        assert!(is_ready(&status(true, true)));
        assert!(!is_ready(&status(false, true)));
        assert!(!is_ready(&status(true, false)));
        let r = admin_response(&Route::Ready, &status(true, false), 100, Default::default);
        assert_eq!(r.code, 503);
        assert!(r.retry_after);
        let r = admin_response(&Route::Ready, &status(true, true), 100, Default::default);
        assert_eq!(r.code, 200);
    }

    #[test]
    fn members_stats_region_and_shard_of() {
        let st = status(true, true);
        let r = admin_response(&Route::Members, &st, 100, Default::default);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["members"][0]["leader"], true);
        assert_eq!(v["members"][1]["oldest"], true);
        assert_eq!(v["members"][1]["reachable"], false);
        // Uids are strings: 64-bit values do not survive a double.
        let mut big = st.clone();
        big.members[0].uid = u64::MAX - 1;
        let r = admin_response(&Route::Members, &big, 100, Default::default);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["members"][0]["uid"], (u64::MAX - 1).to_string());

        let t = TypeName::new("counter").unwrap();
        let r = admin_response(
            &Route::ShardingStats {
                type_name: t.clone(),
            },
            &st,
            100,
            Default::default,
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["members"][0]["regions"][0]["shard_count"], 1);
        assert_eq!(v["members"][0]["regions"][0]["shards"]["3"], 1);
        assert_eq!(v["total_entities"], 1);
        assert_eq!(v["failed"].as_array().map(Vec::len), Some(0));
        let r = admin_response(&Route::Region { type_name: t }, &st, 100, Default::default);
        assert!(body(&r).contains("\"a\""));
        let other = TypeName::new("nope").unwrap();
        let r = admin_response(
            &Route::Region { type_name: other },
            &st,
            100,
            Default::default,
        );
        assert_eq!(r.code, 404);

        let id = EntityId::new("a").unwrap();
        let r = admin_response(
            &Route::ShardOf {
                entity_id: id.clone(),
                shards: Some(10),
            },
            &st,
            100,
            Default::default,
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["shard"], shard_id_of("a", 10).0);
        assert!(v["home"].is_null());
    }

    #[test]
    fn coordinator_admin_answers_map_to_http() {
        use crate::envelope::Status;
        let r = coordinator_admin_response(Ok(b"{}".to_vec()));
        assert_eq!((r.code, r.body.as_slice()), (200, &b"{}\n"[..]));
        let r = coordinator_admin_response(Err((Status::Unavailable, "no coordinator".into())));
        assert_eq!(r.code, 503);
        assert!(r.retry_after);
        assert_eq!(body(&r), "no coordinator\n");
        let r = coordinator_admin_response(Err((Status::UnknownEntityType, "nope".into())));
        assert_eq!(r.code, 404);
        assert!(!r.retry_after);
    }

    #[test]
    fn dispatch_routes_and_refuses() {
        let req = |m, t: &str| Request {
            method: m,
            target: t.into(),
            keep_alive: true,
            body: b"add 1".to_vec(),
        };
        match dispatch(req(Method::Post, "/v1/entities/counter/a%2F..")) {
            Action::Ask {
                entity_id, payload, ..
            } => {
                assert_eq!(entity_id.as_str(), "a/..");
                assert_eq!(payload, b"add 1");
            }
            a => panic!("{a:?}"),
        }
        match dispatch(req(Method::Get, "/v1/entities/counter/a")) {
            Action::Respond(r) => {
                assert_eq!(r.code, 405);
                assert_eq!(r.allow, Some("POST"));
            }
            a => panic!("{a:?}"),
        }
        assert_eq!(
            dispatch(req(Method::Get, "/metrics")),
            Action::Admin(Route::Metrics)
        );
        let r = error_response(&HttpError::BodyTooLarge {
            len_bytes: 5,
            max_bytes: 4,
        });
        assert_eq!(r.code, 413);
        assert!(body(&r).contains("exceeds"));
    }
}
