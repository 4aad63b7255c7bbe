//! The HTTP router: request target → [`Route`].
//!
//! | method | path | route |
//! |---|---|---|
//! | POST | `/v1/entities/{type}/{id}` | [`Route::Entity`] |
//! | GET | `/v1/cluster/members` | [`Route::Members`] |
//! | GET | `/v1/sharding/shard-of/{id}?shards=N` | [`Route::ShardOf`] |
//! | GET | `/v1/sharding/{type}/stats` | [`Route::ShardingStats`] |
//! | GET | `/v1/sharding/{type}/region` | [`Route::Region`] |
//! | GET | `/v1/coordinator/allocation` | [`Route::Allocation`] |
//! | POST | `/v1/coordinator/rebalance[?type=T]` | [`Route::Rebalance`] |
//! | GET | `/health/live` | [`Route::Live`] |
//! | GET | `/health/ready` | [`Route::Ready`] |
//! | GET | `/metrics` | [`Route::Metrics`] |
//!
//! `HEAD` is accepted wherever `GET` is. `/v1/sharding/shard-of/...` is the
//! shard-of route even for an entity type named `shard-of`.
//!
//! Path segments are split on a literal `/` first and then percent-decoded
//! (RFC 3986 section 2.1), so an id containing `/` must be sent as `%2F`
//! (`/v1/entities/t/a%2Fb` is the id `a/b`; `/v1/entities/t/a/b` is `404`).
//! `.` and `..` segments have no path meaning: `..` is an ordinary id. `+`
//! is a plus sign, not a space. The decoded type name and id must be UTF-8,
//! 1 to 255 bytes, and contain no NUL byte, and the type name no `|`, no
//! leading `__` and not be `coordinator` (`TypeName`); otherwise the answer
//! is `400` with the reason. The query string is ignored except by the shard-of
//! and rebalance routes.

use shardline_core::ids::{EntityId, IdError, TypeName};
use thiserror::Error;

use super::codec::Method;

/// A routed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/entities/{type}/{id}`: ask the entity; the body is the message.
    Entity {
        /// The entity type.
        type_name: TypeName,
        /// The entity id (percent-decoded).
        entity_id: EntityId,
    },
    /// `GET /v1/cluster/members`.
    Members,
    /// `GET /v1/sharding/{type}/stats`: shards and entity counts per region.
    ShardingStats {
        /// The entity type.
        type_name: TypeName,
    },
    /// `GET /v1/sharding/{type}/region`: this node's regions of the type.
    Region {
        /// The entity type.
        type_name: TypeName,
    },
    /// `GET /v1/sharding/shard-of/{id}?shards=N`.
    ShardOf {
        /// The entity id (percent-decoded).
        entity_id: EntityId,
        /// `shards=N` from the query (1..=u32::MAX); `None` means the node's
        /// `number_of_shards`.
        shards: Option<u32>,
    },
    /// `GET /v1/coordinator/allocation`: the coordinators' allocation
    /// table, from the member that runs them.
    Allocation,
    /// `POST /v1/coordinator/rebalance[?type=T]`: one rebalance round now,
    /// for type `T` or every type.
    Rebalance {
        /// `type=T` from the query (percent-decoded); `None`: every type.
        type_name: Option<TypeName>,
    },
    /// `GET /health/live`.
    Live,
    /// `GET /health/ready`.
    Ready,
    /// `GET /metrics`.
    Metrics,
}

/// Why a request target was not routed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RouteError {
    /// No route for the path (`404`).
    #[error("no route for {0}")]
    NotFound(String),
    /// The path exists but not for this method (`405`); `allow` is the
    /// `Allow` header value.
    #[error("method not allowed; use {allow}")]
    MethodNotAllowed {
        /// The allowed methods.
        allow: &'static str,
    },
    /// A path segment or the query is invalid (`400`).
    #[error("{0}")]
    BadRequest(String),
}

impl RouteError {
    /// The status code: 404, 405 or 400.
    pub fn status_code(&self) -> u16 {
        match self {
            RouteError::NotFound(_) => 404,
            RouteError::MethodNotAllowed { .. } => 405,
            RouteError::BadRequest(_) => 400,
        }
    }
}

/// Most path segments looked at; longer paths are `404`.
const MAX_SEGMENTS: usize = 8;

/// Routes a request by method and raw target.
///
/// # Errors
/// [`RouteError::NotFound`] for an unknown path,
/// [`RouteError::MethodNotAllowed`] for a known path with another method,
/// [`RouteError::BadRequest`] for an invalid id, type name or query.
pub fn route(method: Method, target: &str) -> Result<Route, RouteError> {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let not_found = || RouteError::NotFound(truncate(path).to_string());
    let rest = path.strip_prefix('/').ok_or_else(not_found)?;
    let mut seg = [""; MAX_SEGMENTS];
    let mut n = 0;
    for s in rest.split('/') {
        if n == MAX_SEGMENTS {
            return Err(not_found());
        }
        seg[n] = s;
        n += 1;
    }
    let seg = &seg[..n];
    let get = |r: Route| match method {
        Method::Get | Method::Head => Ok(r),
        _ => Err(RouteError::MethodNotAllowed { allow: "GET, HEAD" }),
    };
    match seg {
        ["v1", "entities", t, id] => {
            if method != Method::Post {
                return Err(RouteError::MethodNotAllowed { allow: "POST" });
            }
            Ok(Route::Entity {
                type_name: type_name(t)?,
                entity_id: entity_id(id)?,
            })
        }
        ["v1", "cluster", "members"] => get(Route::Members),
        ["v1", "sharding", "shard-of", id] => {
            let r = Route::ShardOf {
                entity_id: entity_id(id)?,
                shards: shards_param(query)?,
            };
            get(r)
        }
        ["v1", "sharding", t, "stats"] => {
            let r = Route::ShardingStats {
                type_name: type_name(t)?,
            };
            get(r)
        }
        ["v1", "sharding", t, "region"] => {
            let r = Route::Region {
                type_name: type_name(t)?,
            };
            get(r)
        }
        ["v1", "coordinator", "allocation"] => {
            if query.is_some_and(|q| !q.is_empty()) {
                return Err(RouteError::BadRequest(
                    "`/v1/coordinator/allocation` takes no query parameters (it lists every type)"
                        .to_string(),
                ));
            }
            get(Route::Allocation)
        }
        ["v1", "coordinator", "rebalance"] => {
            if method != Method::Post {
                return Err(RouteError::MethodNotAllowed { allow: "POST" });
            }
            Ok(Route::Rebalance {
                type_name: type_param(query)?,
            })
        }
        ["health", "live"] => get(Route::Live),
        ["health", "ready"] => get(Route::Ready),
        ["metrics"] => get(Route::Metrics),
        _ => Err(not_found()),
    }
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(128);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn decode_id(kind: &str, raw: &str) -> Result<Vec<u8>, RouteError> {
    let b = percent_decode(raw).map_err(|e| RouteError::BadRequest(format!("{kind}: {e}")))?;
    if b.contains(&0) {
        return Err(RouteError::BadRequest(format!(
            "{kind} contains a NUL byte"
        )));
    }
    Ok(b)
}

fn id_error(e: IdError) -> RouteError {
    RouteError::BadRequest(e.to_string())
}

fn entity_id(raw: &str) -> Result<EntityId, RouteError> {
    EntityId::from_bytes(&decode_id("entity id", raw)?).map_err(id_error)
}

fn type_name(raw: &str) -> Result<TypeName, RouteError> {
    TypeName::from_bytes(&decode_id("type name", raw)?).map_err(id_error)
}

/// `shards=N` in the query (other parameters are ignored).
fn shards_param(query: Option<&str>) -> Result<Option<u32>, RouteError> {
    let Some(q) = query else { return Ok(None) };
    let mut found = None;
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "shards" {
            let n = v.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                RouteError::BadRequest(format!(
                    "shards must be an integer from 1 to {}, got `{}`",
                    u32::MAX,
                    truncate(v)
                ))
            })?;
            found = Some(n);
        }
    }
    Ok(found)
}

/// `type=T` in the query, the only parameter of the rebalance route.
///
/// # Errors
/// [`RouteError::BadRequest`] for any other parameter (a misspelt `type`
/// must not widen the request to every type), a repeated `type`, or an
/// invalid type name.
fn type_param(query: Option<&str>) -> Result<Option<TypeName>, RouteError> {
    let Some(q) = query else { return Ok(None) };
    let mut found = None;
    for pair in q.split('&') {
        if pair.is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some(("type", v)) => {
                if found.is_some() {
                    return Err(RouteError::BadRequest(
                        "the query parameter `type` is given more than once".to_string(),
                    ));
                }
                found = Some(type_name(v)?);
            }
            None if pair == "type" => {
                return Err(RouteError::BadRequest(
                    "the query parameter `type` needs a value (`type=NAME`)".to_string(),
                ));
            }
            _ => {
                let k = pair.split_once('=').map_or(pair, |(k, _)| k);
                return Err(RouteError::BadRequest(format!(
                    "unknown query parameter `{}` (only `type` is accepted)",
                    truncate(k).escape_debug()
                )));
            }
        }
    }
    Ok(found)
}

/// Errors of [`percent_decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PercentError {
    /// A `%` not followed by two hex digits.
    #[error("`%` must be followed by two hex digits")]
    BadEscape,
    /// The decoded bytes would exceed 255 bytes (the longest id).
    #[error("longer than 255 bytes")]
    TooLong,
}

/// Percent-decodes one path segment (RFC 3986 section 2.1) into bytes; the
/// result may be any bytes (UTF-8 is checked by the caller). Output is
/// bounded: more than 255 decoded bytes is [`PercentError::TooLong`].
///
/// # Errors
/// [`PercentError::BadEscape`], [`PercentError::TooLong`].
pub fn percent_decode(s: &str) -> Result<Vec<u8>, PercentError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len().min(shardline_core::ids::MAX_ID_LEN_BYTES));
    let mut i = 0;
    while i < b.len() {
        if out.len() == shardline_core::ids::MAX_ID_LEN_BYTES {
            return Err(PercentError::TooLong);
        }
        if b[i] == b'%' {
            let hi = b.get(i + 1).and_then(|c| hex(*c));
            let lo = b.get(i + 2).and_then(|c| hex(*c));
            match (hi, lo) {
                (Some(h), Some(l)) => out.push(h << 4 | l),
                _ => return Err(PercentError::BadEscape),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(t: &str) -> Result<Route, RouteError> {
        route(Method::Post, t)
    }

    fn entity(t: &str) -> (String, String) {
        match post(t).unwrap() {
            Route::Entity {
                type_name,
                entity_id,
            } => (type_name.to_string(), entity_id.to_string()),
            r => panic!("unexpected {r:?}"),
        }
    }

    #[test]
    fn entity_ids_are_percent_decoded() {
        assert_eq!(
            entity("/v1/entities/counter/a"),
            ("counter".into(), "a".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/a%2Fb"),
            ("counter".into(), "a/b".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/.."),
            ("counter".into(), "..".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/."),
            ("counter".into(), ".".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/a+b"),
            ("counter".into(), "a+b".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/%C3%A9"),
            ("counter".into(), "é".into())
        );
        assert_eq!(
            entity("/v1/entities/counter/x?ignored=1"),
            ("counter".into(), "x".into())
        );
    }

    #[test]
    fn bad_ids_are_400() {
        for t in [
            "/v1/entities/counter/",
            "/v1/entities/counter/%00",
            "/v1/entities/counter/a%00b",
            "/v1/entities/counter/%FF",
            "/v1/entities/counter/%C3",
            "/v1/entities/counter/%zz",
            "/v1/entities/counter/%4",
            "/v1/entities//a",
        ] {
            let e = post(t).unwrap_err();
            assert_eq!(e.status_code(), 400, "{t}: {e}");
            assert!(!e.to_string().is_empty());
        }
        let long = format!("/v1/entities/counter/{}", "a".repeat(256));
        assert_eq!(post(&long).unwrap_err().status_code(), 400);
        let ok = format!("/v1/entities/counter/{}", "a".repeat(255));
        assert!(post(&ok).is_ok());
        let long_escaped = format!("/v1/entities/counter/{}", "%41".repeat(256));
        assert_eq!(post(&long_escaped).unwrap_err().status_code(), 400);
    }

    #[test]
    fn coordinator_routes_refuse_queries_they_do_not_take() {
        for q in ["?garbage", "?type=counter", "?type"] {
            let t = format!("/v1/coordinator/allocation{q}");
            let e = route(Method::Get, &t).unwrap_err();
            assert_eq!(e.status_code(), 400, "{t}: {e}");
        }
        let e = route(Method::Post, "/v1/coordinator/rebalance?type").unwrap_err();
        assert_eq!(e.status_code(), 400);
        assert!(e.to_string().contains("needs a value"), "{e}");
        for q in ["?type=", "?foo=bar", "?type=a&type=b"] {
            let t = format!("/v1/coordinator/rebalance{q}");
            assert_eq!(
                route(Method::Post, &t).unwrap_err().status_code(),
                400,
                "{t}"
            );
        }
    }

    #[test]
    fn a_literal_slash_is_not_part_of_an_id() {
        assert_eq!(
            post("/v1/entities/counter/a/b").unwrap_err().status_code(),
            404
        );
        assert_eq!(
            post("/v1/entities/counter/../x").unwrap_err().status_code(),
            404
        );
        assert_eq!(post("/v1/entities/counter").unwrap_err().status_code(), 404);
    }

    #[test]
    fn admin_routes() {
        assert_eq!(route(Method::Get, "/health/live").unwrap(), Route::Live);
        assert_eq!(route(Method::Head, "/health/ready").unwrap(), Route::Ready);
        assert_eq!(route(Method::Get, "/metrics").unwrap(), Route::Metrics);
        assert_eq!(
            route(Method::Get, "/v1/cluster/members").unwrap(),
            Route::Members
        );
        assert_eq!(
            route(Method::Get, "/v1/sharding/counter/stats").unwrap(),
            Route::ShardingStats {
                type_name: TypeName::new("counter").unwrap()
            }
        );
        assert_eq!(
            route(Method::Get, "/v1/sharding/counter/region").unwrap(),
            Route::Region {
                type_name: TypeName::new("counter").unwrap()
            }
        );
        assert_eq!(
            route(Method::Get, "/v1/sharding/shard-of/a%2Fb?shards=7").unwrap(),
            Route::ShardOf {
                entity_id: EntityId::new("a/b").unwrap(),
                shards: Some(7)
            }
        );
        assert_eq!(
            route(Method::Get, "/v1/sharding/shard-of/a").unwrap(),
            Route::ShardOf {
                entity_id: EntityId::new("a").unwrap(),
                shards: None
            }
        );
        assert_eq!(
            route(Method::Get, "/v1/coordinator/allocation").unwrap(),
            Route::Allocation
        );
        assert_eq!(
            route(Method::Post, "/v1/coordinator/rebalance").unwrap(),
            Route::Rebalance { type_name: None }
        );
        assert_eq!(
            route(Method::Post, "/v1/coordinator/rebalance?type=counter").unwrap(),
            Route::Rebalance {
                type_name: Some(TypeName::new("counter").unwrap())
            }
        );
        assert_eq!(
            route(Method::Get, "/v1/coordinator/rebalance")
                .unwrap_err()
                .status_code(),
            405
        );
        assert_eq!(
            route(Method::Post, "/v1/coordinator/rebalance?type=")
                .unwrap_err()
                .status_code(),
            400
        );
        for q in ["shards=0", "shards=x", "shards=", "shards=4294967296"] {
            let t = format!("/v1/sharding/shard-of/a?{q}");
            assert_eq!(
                route(Method::Get, &t).unwrap_err().status_code(),
                400,
                "{q}"
            );
        }
    }

    #[test]
    fn wrong_method_and_unknown_paths() {
        assert_eq!(
            route(Method::Get, "/v1/entities/c/a")
                .unwrap_err()
                .status_code(),
            405
        );
        assert_eq!(
            route(Method::Post, "/metrics").unwrap_err().status_code(),
            405
        );
        assert_eq!(
            route(Method::Other, "/health/live")
                .unwrap_err()
                .status_code(),
            405
        );
        assert_eq!(route(Method::Get, "/").unwrap_err().status_code(), 404);
        assert_eq!(
            route(Method::Get, "/a/b/c/d/e/f/g/h/i/j")
                .unwrap_err()
                .status_code(),
            404
        );
        assert_eq!(
            route(Method::Get, "/metrics/").unwrap_err().status_code(),
            404
        );
    }

    #[test]
    fn percent_decode_is_bounded() {
        assert_eq!(percent_decode("a%20b").unwrap(), b"a b");
        assert_eq!(percent_decode(&"b".repeat(300)), Err(PercentError::TooLong));
        assert_eq!(percent_decode("%"), Err(PercentError::BadEscape));
        assert_eq!(percent_decode("%a"), Err(PercentError::BadEscape));
    }
}
