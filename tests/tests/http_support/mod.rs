//! Helpers of the HTTP front tests: nodes with an `http_address`, and a
//! minimal blocking HTTP/1.1 client over `std::net::TcpStream` (written
//! here so the tests do not trust the server's own codec).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

#[path = "../node_cases/support.rs"]
mod node_support;

// Not every test binary that includes this module uses each of these.
#[allow(unused_imports)]
pub use node_support::{
    shardline_bin, spawn_node, spawn_node_under, spawn_node_with_args, status, NodeProc, Ports,
};

/// The config of node `i` of `n`.
pub fn config_text(ports: Ports, i: usize, n: usize, cores: u16, dir: &Path) -> String {
    config_text_with(ports, i, n, cores, dir, "")
}

/// The config of node `i` of `n` with `http_table` as the body of its
/// `[http]` table (empty: defaults).
pub fn config_text_with(
    ports: Ports,
    i: usize,
    n: usize,
    cores: u16,
    dir: &Path,
    http_table: &str,
) -> String {
    let seeds: Vec<String> = (0..n)
        .map(|j| format!("\"{}\"", ports.cluster(j)))
        .collect();
    format!(
        r#"cluster_address = "{}"
client_address = "{}"
http_address = "{}"
seed_nodes = [{}]
data_cores = {cores}
pin_cores = false
data_dir = "{}"
number_of_shards = 60
durability = "none"
downing_stable_after_ms = 2000
heartbeat_pause_ms = 1500

[http]
{http_table}

[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0

[[entity_types]]
name = "echo"
kind = "echo"
idle_timeout_ms = 0
active_entity_limit = 0
"#,
        ports.cluster(i),
        ports.client(i),
        ports.http(i),
        seeds.join(", "),
        dir.join(format!("node-{i}")).display()
    )
}

/// A running node child; killed on drop.
pub struct HttpNode {
    pub node: NodeProc,
    pub http: SocketAddr,
}

impl HttpNode {
    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.node.child.kill();
        let _ = self.node.child.wait();
    }
}

/// Starts `n` nodes with `data_cores` executors each and HTTP fronts, and
/// waits for their ready lines.
pub fn start_nodes(dir: &Path, ports: Ports, n: usize, data_cores: u16) -> Vec<HttpNode> {
    start_nodes_with(dir, ports, n, data_cores, "")
}

/// As [`start_nodes`], with `http_table` as the `[http]` table's body.
pub fn start_nodes_with(
    dir: &Path,
    ports: Ports,
    n: usize,
    data_cores: u16,
    http_table: &str,
) -> Vec<HttpNode> {
    let bin = shardline_bin();
    let mut nodes = Vec::new();
    for i in 0..n {
        let text = config_text_with(ports, i, n, data_cores, dir, http_table);
        let cfg = dir.join(format!("node-{i}.toml"));
        std::fs::write(&cfg, text).expect("write config");
        let log = dir.join(format!("node-{i}.log"));
        nodes.push(HttpNode {
            node: spawn_node(&bin, &cfg, &log, "info"),
            http: ports.http(i),
        });
    }
    for (i, n) in nodes.iter().enumerate() {
        if n.node.ready.recv_timeout(Duration::from_secs(30)).is_err() {
            let log =
                std::fs::read_to_string(dir.join(format!("node-{i}.log"))).unwrap_or_default();
            panic!("node {i} not ready; log:\n{log}");
        }
    }
    nodes
}

/// One parsed response.
#[derive(Debug, Clone)]
pub struct Resp {
    pub code: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A keep-alive connection.
pub struct Conn {
    pub s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        s.set_nodelay(true).expect("nodelay");
        Conn { s, buf: Vec::new() }
    }

    /// Writes raw bytes.
    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("write");
    }

    /// Sends a POST and reads its response.
    pub fn post(&mut self, path: &str, body: &[u8]) -> Resp {
        self.send(&post_bytes(path, body));
        self.read_response().expect("response")
    }

    /// Sends a GET and reads its response.
    pub fn get(&mut self, path: &str) -> Resp {
        self.send(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes());
        self.read_response().expect("response")
    }

    /// Reads one response; `None` when the server closed first.
    pub fn read_response(&mut self) -> Option<Resp> {
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = String::from_utf8(self.buf[..end].to_vec()).expect("ASCII head");
                let mut lines = head.split("\r\n");
                let status = lines.next().expect("status line");
                let code: u16 = status
                    .split(' ')
                    .nth(1)
                    .and_then(|c| c.parse().ok())
                    .expect("status code");
                let headers: Vec<(String, String)> = lines
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                    .collect();
                let len: usize = headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .map(|(_, v)| v.parse().expect("content-length"))
                    .unwrap_or(0);
                let total = end + 4 + if code == 100 { 0 } else { len };
                if self.buf.len() >= total {
                    let body = self.buf[end + 4..total].to_vec();
                    self.buf.drain(..total);
                    if code == 100 {
                        continue;
                    }
                    return Some(Resp {
                        code,
                        headers,
                        body,
                    });
                }
            }
            let mut tmp = [0u8; 16 * 1024];
            match self.s.read(&mut tmp) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// True when the server closes the connection (EOF or reset) within
    /// `timeout`, after any responses still buffered.
    pub fn closed_within(&mut self, timeout: Duration) -> bool {
        self.s.set_read_timeout(Some(timeout)).expect("timeout");
        let mut tmp = [0u8; 4096];
        let deadline = Instant::now() + timeout;
        loop {
            match self.s.read(&mut tmp) {
                Ok(0) => return true,
                Ok(_) if Instant::now() < deadline => continue,
                Ok(_) => return false,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// The bytes of a POST with a Content-Length body.
pub fn post_bytes(path: &str, body: &[u8]) -> Vec<u8> {
    let mut v = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// Waits until `GET /health/ready` answers 200 on `addr`.
pub fn wait_ready(addr: SocketAddr, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(s) = TcpStream::connect(addr) {
            let mut c = Conn { s, buf: Vec::new() };
            let _ = c.s.set_read_timeout(Some(Duration::from_secs(3)));
            c.send(b"GET /health/ready HTTP/1.1\r\nHost: t\r\n\r\n");
            if c.read_response().is_some_and(|r| r.code == 200) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{addr} not ready in {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
