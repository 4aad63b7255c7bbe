//! The data lanes of a data executor: inbound lanes from other nodes'
//! regions (read `Forward`s, write `Reply`s) and outbound lanes to them
//! (write `Forward`s, read `Reply`s), fed to and from the data plane.

use std::rc::Rc;
use std::time::Duration;

use monoio::io::Splitable;
use shardline_core::ids::{RegionId, UniqueAddress};

use super::{DataExecutor, DataExecutorRef, Transmit};
use crate::envelope::{encode_frame, DataFrame, FrameError, Lane, Status, MAX_FRAME_SIZE_BYTES};
use crate::transport::{self, FrameReader, Outbox, OUTBOX_HIGH_WATER_BYTES};

impl DataExecutor {
    // ----- data lanes -----

    /// A frame on an inbound data lane. `Err` closes the connection.
    pub(crate) fn on_data_frame(
        &mut self,
        conn: u64,
        body: &bytes::Bytes,
    ) -> Result<(), FrameError> {
        let now = self.now();
        let r = self.plane.handle_data_frame(now, conn, body);
        self.run_effects();
        r
    }

    /// A reply on an outbound data lane.
    pub(crate) fn on_link_frame(&mut self, body: &[u8]) -> Result<(), FrameError> {
        let buf = self.host.reply_buffer();
        let r = self.plane.handle_link_frame(body, buf);
        self.run_effects();
        r
    }

    /// The data lane to `to` closed (`connected`: its handshake had
    /// completed); the plane answers what waited on it.
    pub(super) fn link_failed(&mut self, to: &RegionId, outbox: &Rc<Outbox>, connected: bool) {
        let current = self
            .links
            .get(to)
            .is_some_and(|l| Rc::ptr_eq(&l.outbox, outbox));
        if current {
            self.links.remove(to);
        }
        let now = self.now();
        self.plane.handle_link_closed(now, to, connected, current);
        self.run_effects();
    }

    /// Writes a frame on the data lane the plane opened for it; a lane
    /// over its high-water mark or a frame that does not encode is handed
    /// back to the plane, which answers the sender.
    pub(super) fn transmit(&mut self, t: Transmit) {
        let Some(link) = self.links.get(&t.to) else {
            return self
                .plane
                .handle_transmit_refused(t, Status::Unavailable, b"no link".to_vec());
        };
        let outbox = link.outbox.clone();
        if outbox.buf.borrow().len() > OUTBOX_HIGH_WATER_BYTES {
            return self.plane.handle_transmit_refused(
                t,
                Status::BufferFull,
                b"link to the home node is full".to_vec(),
            );
        }
        let encoded = encode_frame(&t.frame, &mut outbox.buf.borrow_mut());
        if let Err(e) = encoded {
            // The fronts, the embedding API and the entity host refuse
            // messages over `requests.max_message_size_bytes` before they
            // are routed; a frame still too long here (the limit's 1 KiB
            // of room for the envelope's names exceeded) is refused too.
            let status = match t.frame {
                DataFrame::System { .. } => Status::BufferFull,
                _ => Status::TooLarge,
            };
            return self
                .plane
                .handle_transmit_refused(t, status, e.to_string().into_bytes());
        }
        outbox.flush();
    }
}

/// An outbound data lane to a remote region: connect, handshake, then write
/// batched `Forward`s and read `Reply`s until it fails.
pub(super) async fn run_link(core: DataExecutorRef, to: RegionId, outbox: Rc<Outbox>) {
    let (hello, addr) = {
        let c = core.borrow();
        let hello = c.fp.hello(
            (&c.me.address.0, c.me.uid.0),
            Lane::Data,
            to.core,
            c.scope.cluster_id(),
        );
        (hello, to.member.address.0.parse::<std::net::SocketAddr>())
    };
    let connected = std::cell::Cell::new(false);
    let result: Result<(), crate::transport::TransportError> = async {
        let addr = addr.map_err(|e| {
            crate::transport::TransportError::Refused(format!("bad member address: {e}"))
        })?;
        let mut stream = transport::connect(addr, Duration::from_secs(2)).await?;
        let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
        let ack = transport::client_handshake(&mut stream, &mut reader, &hello).await?;
        if ack.uid != to.member.uid.0 {
            return Err(crate::transport::TransportError::Refused(format!(
                "{} is incarnation {}, not {}",
                ack.address, ack.uid, to.member.uid.0
            )));
        }
        connected.set(true);
        let (mut r, mut w) = stream.into_split();
        let wb = outbox.clone();
        let writer = monoio::spawn(async move { transport::write_loop(&mut w, wb, None).await });
        loop {
            let range = reader.read_frame(&mut r).await?;
            core.borrow_mut().on_link_frame(reader.body(range))?;
            while let Some(range) = reader.next_frame()? {
                core.borrow_mut().on_link_frame(reader.body(range))?;
            }
            if outbox.closed.get() {
                break;
            }
        }
        outbox.close();
        let _ = writer.await;
        Ok(())
    }
    .await;
    if let Err(e) = &result {
        tracing::debug!(to = %to.member, core = to.core, error = %e, "data lane failed");
    }
    outbox.close();
    core.borrow_mut().link_failed(&to, &outbox, connected.get());
}

/// An inbound data lane: read `Forward`s, route them, write `Reply`s.
pub(super) async fn serve_data_lane(
    core: DataExecutorRef,
    stream: monoio::net::TcpStream,
    peer: UniqueAddress,
) {
    let outbox = Rc::new(Outbox::default());
    let conn = core.borrow_mut().add_conn(outbox.clone());
    let (mut r, mut w) = stream.into_split();
    let wb = outbox.clone();
    monoio::spawn(async move {
        let _ = transport::write_loop(&mut w, wb, None).await;
    });
    let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
    let why: String = loop {
        match reader.fill(&mut r).await {
            Ok(0) => break "closed".into(),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
        let mut err = None;
        loop {
            match reader.next_frame_bytes() {
                Ok(Some(body)) => {
                    if let Err(e) = core.borrow_mut().on_data_frame(conn, &body) {
                        err = Some(e.to_string());
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    err = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(e) = err {
            tracing::warn!(peer = %peer, error = %e, "protocol error on data lane; closing it");
            break e;
        }
    };
    tracing::debug!(peer = %peer, why, "data lane closed");
    core.borrow_mut().remove_conn(conn);
}
