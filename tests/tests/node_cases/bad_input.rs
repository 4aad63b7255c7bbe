//! Bad input on the client port and on the cluster port: random bytes, a
//! 4 GiB length prefix, a truncated frame, a body that is not a valid
//! archive, an unknown entity type, an empty and a 1 MiB entity id. Each gets
//! an error response or a closed connection, and the node keeps answering
//! other clients (asserted after every case).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use rand::{RngCore, SeedableRng};
use shardline::client::{Client, Status};
use shardline::envelope::{
    encode_frame, ClientFrame, Hello, MAX_FRAME_SIZE_BYTES, PROTOCOL_VERSION,
};

use super::support::Cluster;

/// Sends `bytes`, half-closes, and reads until the server closes; true when
/// it closed (EOF or reset) within the timeout.
fn closed_after(addr: SocketAddr, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Sends `bytes` without closing and checks that the server closes.
fn server_closes(addr: SocketAddr, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn still_serving(addr: SocketAddr) {
    let mut c = Client::connect(addr).expect("connect after bad input");
    let r = c
        .ask("echo", "probe", b"ping", Duration::from_secs(5))
        .expect("probe ask");
    assert_eq!((r.status, r.payload.as_slice()), (Status::Ok, &b"ping"[..]));
}

fn frame(f: &ClientFrame) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(f, &mut out).expect("encode");
    out
}

#[test]
fn bad_input_gets_an_error_or_a_closed_connection_and_the_node_keeps_serving() {
    let _one_at_a_time = super::support::serial();
    let cluster = Cluster::start(23_400, 1);
    cluster.wait_ready(Duration::from_secs(60));
    let client_addr = cluster.ports.client(0);
    let cluster_addr = cluster.ports.cluster(0);
    still_serving(client_addr);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);

    for addr in [client_addr, cluster_addr] {
        // Random bytes (a random length prefix is almost surely over the
        // maximum or never completed; both end with a closed connection).
        let mut junk = vec![0u8; 4096];
        rng.fill_bytes(&mut junk);
        assert!(closed_after(addr, &junk), "random bytes on {addr}");
        still_serving(client_addr);

        // A 4 GiB length prefix: refused before anything is allocated.
        assert!(
            server_closes(addr, &u32::MAX.to_le_bytes()),
            "4 GiB prefix on {addr}"
        );
        still_serving(client_addr);
        let over = (MAX_FRAME_SIZE_BYTES as u32 + 1).to_le_bytes();
        assert!(server_closes(addr, &over), "16 MiB + 1 prefix on {addr}");
        still_serving(client_addr);

        // A truncated frame: the header promises 100 bytes, 10 come, then EOF.
        let mut t = 100u32.to_le_bytes().to_vec();
        t.extend_from_slice(&[1u8; 10]);
        assert!(closed_after(addr, &t), "truncated frame on {addr}");
        still_serving(client_addr);

        // A complete frame whose body is not a valid archive.
        let mut bad = 64u32.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0xAB; 64]);
        assert!(server_closes(addr, &bad), "invalid archive on {addr}");
        still_serving(client_addr);
    }

    // A valid client frame on the cluster port is not a Hello: closed.
    let f = frame(&ClientFrame::Request {
        request_id: 1,
        type_name: b"echo".to_vec(),
        entity_id: b"x".to_vec(),
        payload: b"y".to_vec(),
    });
    assert!(
        server_closes(cluster_addr, &f),
        "client frame on the cluster port"
    );
    // A Hello with the wrong sharding fingerprint is refused and closed.
    let mut h = Vec::new();
    encode_frame(
        &Hello {
            protocol_version: PROTOCOL_VERSION,
            address: "127.0.0.1:1".into(),
            uid: 42,
            lane: 0,
            target_core: 0,
            hash_name: "sha1-mod".into(),
            number_of_shards: 7,
            cluster_name: "shardline".into(),
            cluster_id: String::new(),
            journal_identity: "local:0".into(),
            durable: false,
        },
        &mut h,
    )
    .expect("encode hello");
    assert!(server_closes(cluster_addr, &h), "mismatched fingerprint");
    still_serving(client_addr);

    // Error responses on the client port, on a connection that stays usable.
    let mut c = Client::connect(client_addr).expect("connect");
    let r = c
        .ask("no-such-type", "a", b"x", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(r.status, Status::UnknownEntityType);
    let r = c
        .ask("echo", "", b"x", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(r.status, Status::InvalidEntityId);
    let huge = "i".repeat(1 << 20);
    let r = c
        .ask("echo", &huge, b"x", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(r.status, Status::InvalidEntityId);
    let r = c
        .ask("echo", "fine", b"still here", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(
        (r.status, r.payload.as_slice()),
        (Status::Ok, &b"still here"[..])
    );
    // Counter rejects a bad command without failing.
    let r = c
        .ask("counter", "k", b"add nope", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(r.status, Status::Ok);
    assert!(
        r.payload.starts_with(b"error: "),
        "{:?}",
        String::from_utf8_lossy(&r.payload)
    );
    still_serving(client_addr);
}
