//! Fuzzes the node's decoders of untrusted frames: the length-prefixed
//! framing shared by the client, data and control lanes, the rkyv
//! validation (bytecheck) of every frame type the node reads from a
//! socket, the conversions from wire types into the sharding and
//! membership messages, and the membership codec.
//!
//! Checked on every input:
//! - nothing panics and nothing is allocated from an unchecked length
//!   (the framing refuses lengths over the limit before buffering them);
//! - a body that validates deserializes, and re-encoding the value gives a
//!   frame that validates and decodes to the same value (the decoder
//!   accepts only what the encoder can produce, up to rkyv's layout);
//! - membership messages that decode re-encode to bytes that decode to the
//!   same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline::envelope::{
    access, decode_frame_body, encode_frame, next_frame, ClientFrame, ControlFrame, DataFrame,
    Hello, HelloAck, WireRegionMsg, FRAME_HEADER_BYTES,
};
use shardline_core::cluster::codec;
use shardline_core::ids::EntityId;
use shardline_core::sharding::{CoordinatorEvent, CoordinatorMsg, RegionMsg};

/// Frame limit of the fuzzed framing, in bytes (the node's is 16 MiB; a
/// small one makes the over-limit path reachable).
const MAX_FRAME_BYTES: usize = 4096;

/// Re-encodes `value` and checks the new frame decodes to the same value.
fn round_trip<T>(value: &T)
where
    T: PartialEq
        + std::fmt::Debug
        + rkyv::Archive
        + for<'a> rkyv::Serialize<
            rkyv::api::high::HighSerializer<
                Vec<u8>,
                rkyv::ser::allocator::ArenaHandle<'a>,
                rkyv::rancor::Error,
            >,
        >,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let mut out = Vec::new();
    encode_frame(value, &mut out).expect("a decoded value re-encodes");
    let body = &out[FRAME_HEADER_BYTES..];
    let again: T = decode_frame_body(body).expect("a re-encoded frame decodes");
    assert_eq!(&again, value);
}

fn client_frame(body: &[u8]) {
    if access::<ClientFrame>(body).is_err() {
        return;
    }
    let Ok(f) = decode_frame_body::<ClientFrame>(body) else {
        return;
    };
    if let ClientFrame::Request {
        type_name,
        entity_id,
        ..
    } = &f
    {
        // The node answers InvalidEntityId for these; it must not panic.
        if let Ok(id) = std::str::from_utf8(entity_id) {
            let _ = EntityId::new(id);
        }
        let _ = std::str::from_utf8(type_name);
    }
    round_trip(&f);
}

fn data_frame(body: &[u8]) {
    if access::<DataFrame>(body).is_err() {
        return;
    }
    let Ok(f) = decode_frame_body::<DataFrame>(body) else {
        return;
    };
    if let DataFrame::Forward { entity_id, .. } = &f {
        let _ = EntityId::new(entity_id.as_str());
    }
    round_trip(&f);
}

fn control_frame(body: &[u8]) {
    let Ok(f) = decode_frame_body::<ControlFrame>(body) else {
        return;
    };
    match &f {
        ControlFrame::Cluster { bytes } => membership(bytes),
        ControlFrame::ToCoordinator { msg, .. } => {
            let _: CoordinatorMsg = msg.clone().into();
        }
        ControlFrame::CoordinatorEvents { events, .. } => {
            for e in events {
                let _: CoordinatorEvent = e.clone().into();
            }
        }
        ControlFrame::ToRegion { msg, .. } => {
            let _: Result<RegionMsg, _> = RegionMsg::try_from(WireRegionMsg::clone(msg));
        }
        #[allow(unreachable_patterns)]
        _ => {}
    }
    round_trip(&f);
}

fn membership(bytes: &[u8]) {
    if let Ok(m) = codec::decode(bytes) {
        let again = codec::decode(&codec::encode(&m)).expect("re-encoded message decodes");
        assert_eq!(again, m);
    }
}

fuzz_target!(|data: &[u8]| {
    // The whole input as one body of each kind.
    client_frame(data);
    data_frame(data);
    control_frame(data);
    membership(data);
    if let Ok(h) = decode_frame_body::<Hello>(data) {
        round_trip(&h);
    }
    if let Ok(h) = decode_frame_body::<HelloAck>(data) {
        round_trip(&h);
    }
    // The input as a stream of frames, as a socket delivers it.
    let mut pos = 0;
    while pos < data.len() {
        match next_frame(&data[pos..], MAX_FRAME_BYTES) {
            Ok(Some(len)) => {
                assert!(len <= MAX_FRAME_BYTES);
                let body = &data[pos + FRAME_HEADER_BYTES..pos + FRAME_HEADER_BYTES + len];
                client_frame(body);
                data_frame(body);
                control_frame(body);
                pos += FRAME_HEADER_BYTES + len;
            }
            Ok(None) | Err(_) => break,
        }
    }
});
