//! Runtime spike: a minimal server answering the redis inline `PING` with
//! `+PONG\r\n`, on one of three executors, so that `redis-benchmark -t
//! ping_inline` can measure each executor's CPU cost per request.
//!
//! Usage: `runtime_spike <glommio|monoio|monoio-plain|tokio> <port>`.
//! The server runs on the calling thread; pin it with `taskset`.

use std::net::SocketAddr;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Read buffer size per connection, in bytes.
const BUF_BYTES: usize = 16 * 1024;

/// Counts complete inline commands (one per `\n`) in `buf`.
fn count_commands(buf: &[u8]) -> usize {
    buf.iter().filter(|&&b| b == b'\n').count()
}

/// Fills `out` with one `+PONG\r\n` per command.
fn fill_replies(out: &mut Vec<u8>, n: usize) {
    out.clear();
    for _ in 0..n {
        out.extend_from_slice(b"+PONG\r\n");
    }
}

fn run_glommio(addr: SocketAddr) -> anyhow::Result<()> {
    use futures_lite::{AsyncReadExt, AsyncWriteExt};
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spin_before_park(std::time::Duration::from_micros(50))
        .make()
        .map_err(|e| anyhow::anyhow!("glommio executor: {e}"))?
        .run(async move {
            let listener = glommio::net::TcpListener::bind(addr).expect("bind");
            loop {
                let Ok(mut stream) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                glommio::spawn_local(async move {
                    let mut buf = vec![0u8; BUF_BYTES];
                    let mut out = Vec::with_capacity(BUF_BYTES);
                    loop {
                        let n = match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        fill_replies(&mut out, count_commands(&buf[..n]));
                        if stream.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                })
                .detach();
            }
        });
    Ok(())
}

fn run_monoio(addr: SocketAddr, flags: bool) -> anyhow::Result<()> {
    use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
    let mut urb = io_uring::IoUring::builder();
    if flags {
        urb.setup_coop_taskrun().setup_taskrun_flag();
    }
    let mut rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
        .uring_builder(urb)
        .with_entries(1024)
        .build()?;
    rt.block_on(async move {
        let listener = monoio::net::TcpListener::bind(addr).expect("bind");
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            monoio::spawn(async move {
                let mut buf = vec![0u8; BUF_BYTES];
                let mut out = Vec::with_capacity(BUF_BYTES);
                loop {
                    let (res, b) = stream.read(buf).await;
                    buf = b;
                    let n = match res {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    fill_replies(&mut out, count_commands(&buf[..n]));
                    let (res, o) = stream.write_all(out).await;
                    out = o;
                    if res.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

fn run_tokio(addr: SocketAddr) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::task::spawn_local(async move {
                let mut buf = vec![0u8; BUF_BYTES];
                let mut out = Vec::with_capacity(BUF_BYTES);
                loop {
                    let n = match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    fill_replies(&mut out, count_commands(&buf[..n]));
                    if stream.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() == 3,
        "usage: runtime_spike <glommio|monoio|monoio-plain|tokio> <port>"
    );
    let addr: SocketAddr = format!("127.0.0.1:{}", args[2]).parse()?;
    match args[1].as_str() {
        "glommio" => run_glommio(addr),
        "monoio" => run_monoio(addr, true),
        "monoio-plain" => run_monoio(addr, false),
        "tokio" => run_tokio(addr),
        other => anyhow::bail!("unknown runtime {other}"),
    }
}
