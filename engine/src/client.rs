//! The blocking native-protocol client (`docs/interfaces.md`, "Native client
//! protocol"): one TCP connection to a node's `client_address`, usable for
//! single round trips ([`Client::ask`]) or split into a writer and a reader for
//! pipelining ([`Client::into_split`]).
//!
//! Frames are length-prefixed rkyv archives ([`crate::envelope`]).

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use thiserror::Error;

pub use crate::envelope::Status;
use crate::envelope::{
    access, encode_frame, ArchivedServerFrame, ClientFrame, ServerFrame, FRAME_HEADER_BYTES,
    MAX_FRAME_SIZE_BYTES,
};
pub use crate::status::NodeStatus;

/// Client errors.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Connecting, reading or writing failed (includes a read timeout, as
    /// `WouldBlock`/`TimedOut`).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent a frame that is not a valid response.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The server closed the connection.
    #[error("connection closed by the server")]
    Closed,
    /// The response to `ask` carried another request id.
    #[error("response for request {got}, expected {expected}")]
    UnexpectedResponse {
        /// Id sent.
        expected: u64,
        /// Id received.
        got: u64,
    },
    /// `node_status` was answered with an error status.
    #[error("status request failed: {0:?}")]
    Status(Status),
    /// A coordinator admin request ([`Client::allocation`],
    /// [`Client::rebalance`]) was refused: `Unavailable` when no coordinator
    /// runs or its member did not answer, `UnknownEntityType` for a type
    /// without a coordinator.
    #[error("{status:?}: {reason}")]
    Refused {
        /// The status.
        status: Status,
        /// The node's reason.
        reason: String,
    },
}

/// A response to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The request's id; 0 for a frame about the connection (a refused
    /// frame or connection), after which the node closes it.
    pub request_id: u64,
    /// The outcome.
    pub status: Status,
    /// The entity's reply (or a reason text for error statuses).
    pub payload: Vec<u8>,
}

/// One TCP connection to a node's client address.
pub struct Client {
    writer: RequestWriter,
    reader: ResponseReader,
    next_id: u64,
}

impl Client {
    /// Connects (TCP_NODELAY on).
    ///
    /// # Errors
    /// [`ClientError::Io`] when the connection fails.
    pub fn connect(addr: SocketAddr) -> Result<Client, ClientError> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        Client::from_stream(stream)
    }

    /// A client on a connection made by the caller (e.g. with socket
    /// options of its own, set before connecting); TCP_NODELAY is turned
    /// on.
    ///
    /// # Errors
    /// [`ClientError::Io`] when the socket cannot be configured or cloned.
    pub fn from_stream(stream: TcpStream) -> Result<Client, ClientError> {
        stream.set_nodelay(true)?;
        let read = stream.try_clone()?;
        Ok(Client {
            writer: RequestWriter {
                out: BufWriter::with_capacity(64 * 1024, stream),
                buf: Vec::with_capacity(256),
            },
            reader: ResponseReader {
                inp: BufReader::with_capacity(64 * 1024, read),
                body: Vec::new(),
            },
            next_id: 1,
        })
    }

    /// One request/response round trip (not pipelined). A response with
    /// request id 0 is returned as it is: the node refused the frame
    /// (`TooLarge`) or the connection (`Unavailable`, the core's
    /// `requests.max_native_connections_per_core`) and closes the
    /// connection.
    ///
    /// # Errors
    /// [`ClientError::Io`] on a socket error or when no response came within
    /// `timeout` (the connection should then be dropped: a late response may
    /// still arrive), [`ClientError::Closed`], [`ClientError::Protocol`].
    pub fn ask(
        &mut self,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let sent = self
            .writer
            .send(id, type_name, entity_id, payload)
            .and_then(|()| self.writer.flush());
        if let Err(e) = sent {
            // The node may have refused the connection (or the frame) and
            // closed it while the request was still being written: its
            // frame about the connection (request id 0) is still readable.
            if matches!(e, ClientError::Io(_)) {
                if let Ok(r) = self.recv_with_timeout(timeout.min(Duration::from_secs(1))) {
                    if r.request_id == 0 {
                        return Ok(r);
                    }
                }
            }
            return Err(e);
        }
        let r = self.recv_with_timeout(timeout)?;
        if r.request_id == 0 {
            // About the connection, not a request (ids start at 1): the
            // node refused the frame before reading its request id
            // (`TooLarge`: longer than its message limit) or refused the
            // connection (`Unavailable`: the core's connection limit), and
            // closes the connection.
            return Ok(r);
        }
        if r.request_id != id {
            return Err(ClientError::UnexpectedResponse {
                expected: id,
                got: r.request_id,
            });
        }
        Ok(r)
    }

    /// Sends raw bytes as they are (for tests of malformed input).
    ///
    /// # Errors
    /// [`ClientError::Io`].
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.writer.out.write_all(bytes)?;
        self.writer.out.flush()?;
        Ok(())
    }

    fn recv_with_timeout(&mut self, timeout: Duration) -> Result<Response, ClientError> {
        let t = if timeout.is_zero() {
            Duration::from_millis(1)
        } else {
            timeout
        };
        self.reader.inp.get_ref().set_read_timeout(Some(t))?;
        self.reader.recv()
    }

    /// Splits the connection for pipelining: one thread writes, another reads.
    pub fn into_split(self) -> (RequestWriter, ResponseReader) {
        let _ = self.reader.inp.get_ref().set_read_timeout(None);
        (self.writer, self.reader)
    }

    /// Admin: this node's view of the cluster.
    ///
    /// # Errors
    /// As [`Self::ask`]; [`ClientError::Protocol`] when the JSON does not parse.
    pub fn node_status(&mut self, timeout: Duration) -> Result<NodeStatus, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.writer.buf.clear();
        encode_frame(
            &ClientFrame::NodeStatus { request_id: id },
            &mut self.writer.buf,
        )
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.writer.out.write_all(&self.writer.buf)?;
        self.writer.flush()?;
        let r = self.recv_with_timeout(timeout)?;
        if r.status != Status::Ok {
            return Err(ClientError::Status(r.status));
        }
        serde_json::from_slice(&r.payload).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Admin: the coordinators' allocation table (every allocated shard's
    /// home, generation and hand-off), from the member that runs them (the
    /// node asked forwards the request there).
    ///
    /// # Errors
    /// As [`Self::ask`]; [`ClientError::Refused`] with the node's reason;
    /// [`ClientError::Protocol`] when the JSON does not parse.
    pub fn allocation(
        &mut self,
        timeout: Duration,
    ) -> Result<crate::status::AllocationTable, ClientError> {
        self.coordinator_admin(false, None, timeout)
    }

    /// Admin: runs one rebalance round of the coordinator of `type_name`
    /// (every type when `None`) now, and answers the hand-offs it started.
    ///
    /// # Errors
    /// As [`Self::allocation`].
    pub fn rebalance(
        &mut self,
        type_name: Option<&str>,
        timeout: Duration,
    ) -> Result<crate::status::RebalanceAnswer, ClientError> {
        self.coordinator_admin(true, type_name, timeout)
    }

    fn coordinator_admin<T: serde::de::DeserializeOwned>(
        &mut self,
        rebalance: bool,
        type_name: Option<&str>,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.writer.buf.clear();
        encode_frame(
            &ClientFrame::CoordinatorAdmin {
                request_id: id,
                rebalance,
                type_name: type_name.unwrap_or("").as_bytes().to_vec(),
            },
            &mut self.writer.buf,
        )
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.writer.out.write_all(&self.writer.buf)?;
        self.writer.flush()?;
        let r = self.recv_with_timeout(timeout)?;
        if r.status != Status::Ok {
            return Err(ClientError::Refused {
                status: r.status,
                reason: String::from_utf8_lossy(&r.payload).into_owned(),
            });
        }
        serde_json::from_slice(&r.payload).map_err(|e| ClientError::Protocol(e.to_string()))
    }
}

/// Appends the frame of one entity request to `out`: what
/// [`RequestWriter::send`] writes, for a client that does its own I/O (an
/// event loop).
///
/// # Errors
/// [`ClientError::Protocol`] when the request exceeds the frame limit
/// ([`crate::envelope::MAX_FRAME_SIZE_BYTES`]); `out` is then left as it
/// was.
pub fn encode_request(
    out: &mut Vec<u8>,
    request_id: u64,
    type_name: &str,
    entity_id: &str,
    payload: &[u8],
) -> Result<(), ClientError> {
    let f = ClientFrame::Request {
        request_id,
        type_name: type_name.as_bytes().to_vec(),
        entity_id: entity_id.as_bytes().to_vec(),
        payload: payload.to_vec(),
    };
    encode_frame(&f, out).map_err(|e| ClientError::Protocol(e.to_string()))
}

/// The writing half of a split [`Client`].
pub struct RequestWriter {
    out: BufWriter<TcpStream>,
    buf: Vec<u8>,
}

impl RequestWriter {
    /// Queues one request (buffered; call [`Self::flush`]).
    ///
    /// # Errors
    /// [`ClientError::Io`] when the buffer had to be written and that failed;
    /// [`ClientError::Protocol`] when the request exceeds the frame limit.
    pub fn send(
        &mut self,
        request_id: u64,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
    ) -> Result<(), ClientError> {
        self.buf.clear();
        encode_request(&mut self.buf, request_id, type_name, entity_id, payload)?;
        self.out.write_all(&self.buf)?;
        Ok(())
    }

    /// Writes everything queued.
    ///
    /// # Errors
    /// [`ClientError::Io`].
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.out.flush()?;
        Ok(())
    }
}

/// The reading half of a split [`Client`].
pub struct ResponseReader {
    inp: BufReader<TcpStream>,
    body: Vec<u8>,
}

impl ResponseReader {
    /// Blocks until the next response arrives.
    ///
    /// # Errors
    /// [`ClientError::Closed`] at end of stream, [`ClientError::Io`],
    /// [`ClientError::Protocol`] for a malformed frame.
    pub fn recv(&mut self) -> Result<Response, ClientError> {
        let mut hdr = [0u8; FRAME_HEADER_BYTES];
        if let Err(e) = self.inp.read_exact(&mut hdr) {
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ClientError::Closed
            } else {
                ClientError::Io(e)
            });
        }
        let len = u32::from_le_bytes(hdr) as usize;
        if len > MAX_FRAME_SIZE_BYTES {
            return Err(ClientError::Protocol(format!("frame of {len} bytes")));
        }
        self.body.resize(len, 0);
        self.inp.read_exact(&mut self.body).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ClientError::Closed
            } else {
                ClientError::Io(e)
            }
        })?;
        let a =
            access::<ServerFrame>(&self.body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        decode_response(a)
    }
}

fn decode_response(a: &ArchivedServerFrame) -> Result<Response, ClientError> {
    let status = Status::from_u8(a.status)
        .ok_or_else(|| ClientError::Protocol(format!("unknown status {}", a.status)))?;
    Ok(Response {
        request_id: a.request_id.to_native(),
        status,
        payload: a.payload.as_slice().to_vec(),
    })
}
