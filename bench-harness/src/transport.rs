//! How the harness talks to a node: a small trait over the native client
//! (`shardline::client`), so the load driver's bookkeeping can be unit
//! tested against an in-process fake.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;

use crate::stats::ErrorKind;

/// A node's answer to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The id the request was sent with.
    pub request_id: u64,
    /// `None` when the node answered Ok, else the error kind of its status.
    pub error: Option<ErrorKind>,
    /// Reply payload (ASCII for the built-in entity types).
    pub payload: Vec<u8>,
}

/// The sending half of a pipelined connection (buffered).
pub trait RequestSink: Send {
    /// Buffers one request.
    ///
    /// # Errors
    /// When the connection is broken.
    fn send(
        &mut self,
        request_id: u64,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
    ) -> Result<()>;
    /// Writes the buffered requests to the socket.
    ///
    /// # Errors
    /// When the connection is broken.
    fn flush(&mut self) -> Result<()>;
}

/// The receiving half of a pipelined connection.
pub trait ReplySource: Send {
    /// Blocks until the next reply.
    ///
    /// # Errors
    /// When the connection is broken or closed.
    fn recv(&mut self) -> Result<Reply>;
}

/// Opens connections to nodes.
pub trait Connector: Send + Sync {
    /// Connects to the client address `addr`, split for pipelining.
    ///
    /// # Errors
    /// When the TCP connection cannot be made.
    fn connect(&self, addr: SocketAddr) -> Result<(Box<dyn RequestSink>, Box<dyn ReplySource>)>;

    /// One request/response round trip on a fresh connection.
    ///
    /// # Errors
    /// Connection failures and a missing reply within `timeout`.
    fn ask(
        &self,
        addr: SocketAddr,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Reply>;

    /// The node's status, as JSON (the node's `NodeStatus` serialized).
    ///
    /// # Errors
    /// Connection failures and a missing reply within `timeout`.
    fn node_status(&self, addr: SocketAddr, timeout: Duration) -> Result<serde_json::Value>;
}

/// Sums every number stored under the key `field` anywhere in a JSON value
/// (e.g. `messages_delivered` over all regions of a node's status).
pub fn sum_field(value: &serde_json::Value, field: &str) -> u64 {
    match value {
        serde_json::Value::Object(map) => map
            .iter()
            .map(|(k, v)| {
                if k == field {
                    v.as_u64().unwrap_or_else(|| sum_field(v, field))
                } else {
                    sum_field(v, field)
                }
            })
            .sum(),
        serde_json::Value::Array(items) => items.iter().map(|v| sum_field(v, field)).sum(),
        _ => 0,
    }
}

#[cfg(test)]
pub mod fake {
    //! An in-process stand-in for a node, for the driver's unit tests only:
    //! echo and counter semantics, node-status counters, and an optional
    //! connection break after a number of requests.

    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};

    type Wire = (u64, String, String, Vec<u8>);

    /// Shared state of the fake node.
    #[derive(Default)]
    pub struct FakeNode {
        counters: Mutex<HashMap<String, i64>>,
        delivered: AtomicU64,
        activated: AtomicU64,
        /// Break a connection after this many requests on it (0 = never).
        pub break_after: u64,
        /// Answer every request to this entity with BufferFull.
        pub refuse_entity: Option<String>,
    }

    impl FakeNode {
        /// Breaks every connection after `n` requests on it.
        pub fn breaking_after(mut self, n: u64) -> FakeNode {
            self.break_after = n;
            self
        }

        /// Refuses every request to `entity` with BufferFull.
        pub fn refusing(mut self, entity: &str) -> FakeNode {
            self.refuse_entity = Some(entity.to_string());
            self
        }

        fn handle(
            &self,
            type_name: &str,
            entity: &str,
            payload: &[u8],
        ) -> (Option<ErrorKind>, Vec<u8>) {
            if self.refuse_entity.as_deref() == Some(entity) {
                return (Some(ErrorKind::BufferFull), Vec::new());
            }
            self.delivered.fetch_add(1, Ordering::Relaxed);
            match type_name {
                "echo" => (None, payload.to_vec()),
                "counter" => {
                    let mut counters = self.counters.lock().unwrap();
                    let key = entity.to_string();
                    if !counters.contains_key(&key) {
                        self.activated.fetch_add(1, Ordering::Relaxed);
                    }
                    let value = counters.entry(key).or_insert(0);
                    let text = String::from_utf8_lossy(payload);
                    if let Some(n) = text.strip_prefix("add ") {
                        *value += n.parse::<i64>().unwrap();
                    }
                    (None, value.to_string().into_bytes())
                }
                _ => (Some(ErrorKind::UnknownEntityType), Vec::new()),
            }
        }
    }

    struct Sink {
        buffer: Vec<Wire>,
        tx: mpsc::Sender<Vec<Wire>>,
    }
    impl RequestSink for Sink {
        fn send(&mut self, id: u64, t: &str, e: &str, p: &[u8]) -> Result<()> {
            self.buffer
                .push((id, t.to_string(), e.to_string(), p.to_vec()));
            Ok(())
        }
        fn flush(&mut self) -> Result<()> {
            let batch = std::mem::take(&mut self.buffer);
            self.tx
                .send(batch)
                .map_err(|_| anyhow::anyhow!("connection closed"))
        }
    }
    struct Source(mpsc::Receiver<Reply>);
    impl ReplySource for Source {
        fn recv(&mut self) -> Result<Reply> {
            self.0
                .recv()
                .map_err(|_| anyhow::anyhow!("connection closed"))
        }
    }

    /// Connector to one [`FakeNode`] whatever the address.
    pub struct FakeConnector(pub Arc<FakeNode>);

    impl Connector for FakeConnector {
        fn connect(
            &self,
            _addr: SocketAddr,
        ) -> Result<(Box<dyn RequestSink>, Box<dyn ReplySource>)> {
            let (req_tx, req_rx) = mpsc::channel::<Vec<Wire>>();
            let (rep_tx, rep_rx) = mpsc::channel();
            let node = self.0.clone();
            std::thread::spawn(move || {
                let mut handled = 0u64;
                while let Ok(batch) = req_rx.recv() {
                    for (id, t, e, p) in batch {
                        handled += 1;
                        if node.break_after > 0 && handled > node.break_after {
                            return;
                        }
                        let (error, payload) = node.handle(&t, &e, &p);
                        if rep_tx
                            .send(Reply {
                                request_id: id,
                                error,
                                payload,
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
            Ok((
                Box::new(Sink {
                    buffer: Vec::new(),
                    tx: req_tx,
                }),
                Box::new(Source(rep_rx)),
            ))
        }

        fn ask(
            &self,
            _addr: SocketAddr,
            t: &str,
            e: &str,
            p: &[u8],
            _timeout: Duration,
        ) -> Result<Reply> {
            let (error, payload) = self.0.handle(t, e, p);
            Ok(Reply {
                request_id: 0,
                error,
                payload,
            })
        }

        fn node_status(&self, _addr: SocketAddr, _timeout: Duration) -> Result<serde_json::Value> {
            Ok(serde_json::json!({
                "regions": [{
                    "messages_delivered": self.0.delivered.load(Ordering::Relaxed),
                    "entities_activated": self.0.activated.load(Ordering::Relaxed),
                }]
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_field_finds_nested_counters() {
        let v = serde_json::json!({
            "regions": [
                {"core": 0, "counters": {"messages_delivered": 5, "entities_activated": 2}},
                {"core": 1, "counters": {"messages_delivered": 7, "entities_activated": 1}}
            ],
            "messages_delivered_total_is_not_this": 100
        });
        assert_eq!(sum_field(&v, "messages_delivered"), 12);
        assert_eq!(sum_field(&v, "entities_activated"), 3);
        assert_eq!(sum_field(&v, "absent"), 0);
    }
}
