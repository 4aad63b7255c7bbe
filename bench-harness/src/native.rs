//! The real transport: Shardline's native client (`shardline::client`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use shardline::client::{Client, RequestWriter, Response, ResponseReader, Status};

use crate::stats::ErrorKind;
use crate::transport::{Connector, Reply, ReplySource, RequestSink};

/// Connects with [`shardline::client::Client`].
pub struct NativeConnector;

fn reply(r: Response) -> Reply {
    let error = match r.status {
        Status::Ok => None,
        Status::UnknownEntityType => Some(ErrorKind::UnknownEntityType),
        Status::InvalidEntityId => Some(ErrorKind::InvalidEntityId),
        Status::BufferFull => Some(ErrorKind::BufferFull),
        Status::TimedOut => Some(ErrorKind::TimedOut),
        Status::EntityFailed => Some(ErrorKind::EntityFailed),
        Status::ShuttingDown => Some(ErrorKind::ShuttingDown),
        Status::JournalUnavailable => Some(ErrorKind::JournalUnavailable),
        Status::Unavailable => Some(ErrorKind::Unavailable),
        Status::TooLarge => Some(ErrorKind::TooLarge),
        #[allow(unreachable_patterns)]
        _ => Some(ErrorKind::OtherStatus),
    };
    Reply {
        request_id: r.request_id,
        error,
        payload: r.payload,
    }
}

impl RequestSink for RequestWriter {
    fn send(
        &mut self,
        request_id: u64,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
    ) -> Result<()> {
        RequestWriter::send(self, request_id, type_name, entity_id, payload)?;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        RequestWriter::flush(self)?;
        Ok(())
    }
}

impl ReplySource for ResponseReader {
    fn recv(&mut self) -> Result<Reply> {
        Ok(reply(ResponseReader::recv(self)?))
    }
}

impl Connector for NativeConnector {
    fn connect(&self, addr: SocketAddr) -> Result<(Box<dyn RequestSink>, Box<dyn ReplySource>)> {
        let (writer, reader) = Client::connect(addr)
            .with_context(|| format!("connect {addr}"))?
            .into_split();
        Ok((Box::new(writer), Box::new(reader)))
    }

    fn ask(
        &self,
        addr: SocketAddr,
        type_name: &str,
        entity_id: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Reply> {
        let mut client = Client::connect(addr).with_context(|| format!("connect {addr}"))?;
        Ok(reply(client.ask(type_name, entity_id, payload, timeout)?))
    }

    fn node_status(&self, addr: SocketAddr, timeout: Duration) -> Result<serde_json::Value> {
        let mut client = Client::connect(addr).with_context(|| format!("connect {addr}"))?;
        let status = client.node_status(timeout)?;
        Ok(serde_json::to_value(&status)?)
    }
}
