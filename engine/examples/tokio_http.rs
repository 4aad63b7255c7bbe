//! An HTTP service on tokio that embeds a Shardline node and asks typed
//! entities from its request handlers, without blocking tokio's worker
//! threads: `typed::EntityRef::ask` returns a future that the node's data
//! core completes.
//!
//! ```text
//! GET  /counters/{id}          -> the value
//! POST /counters/{id}/add/{n}  -> the new value
//! ```
//!
//! Run: `cargo run --release -p shardline --example tokio_http` (it sends
//! a few requests to itself and exits), or with `-- --serve` to keep
//! serving on 127.0.0.1:18080 (`curl -X POST
//! http://127.0.0.1:18080/counters/a/add/5`).
//!
//! The HTTP parsing is deliberately minimal (one request per connection,
//! `httparse`); a real service would use axum or hyper, with the same
//! handler body.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shardline::typed::{self, Context, EntityTypeKey, Postcard, Protocol};
use shardline::{EntityError, EntitySettings, Node, NodeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Serialize, Deserialize)]
enum Command {
    Add(i64),
    Get,
}

struct Counters;
impl Protocol for Counters {
    type Command = Command;
    type Reply = i64;
    type Codec = Postcard;
}

#[derive(Default)]
struct Counter(i64);

impl typed::Entity for Counter {
    type Protocol = Counters;
    fn handle(
        &mut self,
        _ctx: &mut Context<'_, '_, Counters>,
        command: Command,
    ) -> Result<i64, EntityError> {
        if let Command::Add(n) = command {
            self.0 = self
                .0
                .checked_add(n)
                .ok_or_else(|| EntityError::Failed("overflow".into()))?;
        }
        Ok(self.0)
    }
}

const ADDR: &str = "127.0.0.1:18080";

/// Answers one request: (status, body).
async fn route(
    node: &Node,
    key: &EntityTypeKey<Counters>,
    method: &str,
    path: &str,
) -> (u16, String) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (id, command) = match (method, parts.as_slice()) {
        ("GET", ["counters", id]) => (*id, Command::Get),
        ("POST", ["counters", id, "add", n]) => match n.parse() {
            Ok(n) => (*id, Command::Add(n)),
            Err(_) => return (400, "bad number\n".into()),
        },
        _ => return (404, "not found\n".into()),
    };
    let r = match node.typed_ref(key, id) {
        Ok(r) => r,
        Err(e) => return (400, format!("{e}\n")),
    };
    match r.ask(command).await {
        Ok(v) => (200, format!("{v}\n")),
        Err(typed::AskError::TimedOut) => (504, "timed out\n".into()),
        Err(e) => (503, format!("{e}\n")),
    }
}

async fn serve(conn: tokio::net::TcpStream, node: Arc<Node>, key: EntityTypeKey<Counters>) {
    let mut conn = conn;
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    let (status, body) = loop {
        match conn.read(&mut buf[len..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => len += n,
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => {
                let method = req.method.unwrap_or("").to_string();
                let path = req.path.unwrap_or("").to_string();
                break route(&node, &key, &method, &path).await;
            }
            Ok(httparse::Status::Partial) if len < buf.len() => continue,
            _ => break (400, "bad request\n".to_string()),
        }
    };
    let reply = format!(
        "HTTP/1.1 {status} {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        if status == 200 { "OK" } else { "Error" },
        body.len()
    );
    let _ = conn.write_all(reply.as_bytes()).await;
}

async fn request(method: &str, path: &str) -> anyhow::Result<String> {
    let mut c = tokio::net::TcpStream::connect(ADDR).await?;
    c.write_all(format!("{method} {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    c.read_to_string(&mut out).await?;
    // "HTTP/1.1 200 OK" and the body's line.
    let status = out.lines().next().unwrap_or("");
    let body = out.lines().last().unwrap_or("");
    Ok(format!("{status}: {body}"))
}

fn main() -> anyhow::Result<()> {
    let serve_forever = std::env::args().any(|a| a == "--serve");
    let dir = tempfile::tempdir()?;
    let config = NodeConfig::builder(
        "127.0.0.1:17140".parse()?,
        "127.0.0.1:17240".parse()?,
        dir.path(),
    )
    .seed_nodes(["127.0.0.1:17140".parse()?])
    .pin_cores(false)
    .build()?;
    let node = Node::start(config)?;
    let key = EntityTypeKey::<Counters>::new("counter")?;
    node.sharding()
        .start_typed(&key, |_| Counter::default(), EntitySettings::default())?;
    node.wait_ready(Duration::from_secs(30))?;
    let node = Arc::new(node);

    // One tokio thread serves every connection: the asks are futures, so
    // no handler holds the thread while its entity works.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(ADDR).await?;
        let (n, k) = (node.clone(), key.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, n.clone(), k.clone()));
            }
        });
        println!("serving on http://{ADDR}");
        if serve_forever {
            // Until the process is killed (Ctrl-C).
            std::future::pending::<()>().await;
        }
        // 100 concurrent adds from tokio tasks, then the value.
        let mut tasks = Vec::new();
        for _ in 0..100 {
            tasks.push(tokio::spawn(request("POST", "/counters/a/add/2")));
        }
        for t in tasks {
            t.await??;
        }
        println!(
            "GET /counters/a -> {}",
            request("GET", "/counters/a").await?
        );
        println!("GET /nowhere -> {}", request("GET", "/nowhere").await?);
        anyhow::Ok(())
    })?;
    drop(rt);
    if let Ok(node) = Arc::try_unwrap(node) {
        node.leave(Duration::from_secs(10));
    }
    Ok(())
}
