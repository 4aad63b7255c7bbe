//! `shardline status` pointed at something that is not a node's native
//! client port fails with a message naming the address and the likely
//! mistake, not a bare frame error.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;

#[test]
fn status_against_an_http_port_names_the_address_and_the_client_address_key() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
    });
    let out = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(["status", "--node", &addr.to_string()])
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("run shardline status");
    server.join().expect("server thread");
    assert!(!out.status.success(), "status must fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&addr.to_string()), "stderr: {err}");
    assert!(err.contains("client_address"), "stderr: {err}");
}

#[test]
fn status_against_a_closed_port_says_it_cannot_connect() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let out = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(["status", "--node", &addr.to_string()])
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run shardline status");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to"), "stderr: {err}");
}
