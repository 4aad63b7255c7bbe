//! The membership protocol through its public API only, as the node's
//! control core drives it: bytes on the wire, timers from `poll_timeout`.

use std::time::Duration;

use shardline_core::cluster::{
    decode, encode, ClusterConfig, ClusterMessage, ClusterNode, DecodeError, MemberStatus,
    WIRE_VERSION,
};
use shardline_core::ids::{Address, MemberUid, UniqueAddress};

fn ua(a: &str, uid: u64) -> UniqueAddress {
    UniqueAddress {
        address: Address(a.to_string().into()),
        uid: MemberUid(uid),
    }
}

#[test]
fn heartbeat_bytes_are_pinned() {
    let msg = ClusterMessage::Heartbeat {
        from: ua("127.0.0.1:7101", 1),
        to: ua("127.0.0.2:7101", 2),
        sequence_nr: 7,
    };
    let mut want = vec![WIRE_VERSION, 8];
    for (a, uid) in [("127.0.0.1:7101", 1u64), ("127.0.0.2:7101", 2)] {
        want.extend_from_slice(&(a.len() as u32).to_le_bytes());
        want.extend_from_slice(a.as_bytes());
        want.extend_from_slice(&uid.to_le_bytes());
    }
    want.extend_from_slice(&7u64.to_le_bytes());
    assert_eq!(encode(&msg), want);
    assert_eq!(decode(&want), Ok(msg));
    assert_eq!(
        decode(&want[..want.len() - 3]).map(|_| ()),
        Err(DecodeError::Truncated {
            offset: want.len() - 8,
            needed_bytes: 3,
        })
    );
}

#[test]
fn two_nodes_form_a_cluster_over_bytes() {
    let a = Address("127.0.0.1:7101".into());
    let b = Address("127.0.0.1:7102".into());
    let seeds = vec![a.clone(), b.clone()];
    let mut nodes = [
        ClusterNode::new(
            ClusterConfig::new(a.clone(), seeds.clone()),
            MemberUid(11),
            Duration::ZERO,
        ),
        ClusterNode::new(
            ClusterConfig::new(b.clone(), seeds),
            MemberUid(22),
            Duration::ZERO,
        ),
    ];
    let mut wire: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut now = Duration::ZERO;
    // bounded: at most 30 s of virtual time in 10 ms steps
    while now < Duration::from_secs(30) {
        now += Duration::from_millis(10);
        for (to, bytes) in std::mem::take(&mut wire) {
            let msg = decode(&bytes).expect("valid bytes");
            nodes[to].handle_message(now, msg);
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            if n.poll_timeout().is_some_and(|t| t <= now) {
                n.handle_timeout(now);
            }
            assert_eq!(n.poll_stop(), None, "node {i} stopped");
            while n.poll_singleton().is_some() {}
            while n.poll_event().is_some() {}
            while let Some(t) = n.poll_transmit() {
                let to = if t.to == a { 0 } else { 1 };
                wire.push((to, encode(&t.message)));
            }
        }
    }
    for n in &nodes {
        let statuses: Vec<MemberStatus> = n.gossip().members.values().map(|m| m.status).collect();
        assert_eq!(statuses, vec![MemberStatus::Up, MemberStatus::Up]);
        assert!(n.is_available());
        assert_eq!(n.oldest().map(|o| o.address), Some(a.clone()));
    }
}
