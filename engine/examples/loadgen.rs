//! A temporary load driver for the node (until the bench harness drives it):
//! starts `shardline node` children with generated configs and measures
//! requests/s, server CPU µs per request (utime+stime of the node process
//! from /proc) and HdrHistogram latency percentiles.
//!
//! ```text
//! loadgen single --bin target/release/shardline --type echo --conns 50 --depth 16 --secs 5
//! loadgen cross  --bin target/release/shardline --secs 5
//! ```
//! `single`: one node (one data core, pinned with taskset to CPU 0), the
//! driver on CPU 1; each connection is a thread that sends `depth` requests,
//! flushes, and reads `depth` responses (latency per request: send to
//! receive). `cross`: two nodes; one connection to node A asks entities homed
//! on A and entities homed on B at depth 1 and prints both distributions.

use std::io::{BufRead, BufReader};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardline::client::{Client, Status};

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn config(dir: &Path, i: usize, n: usize, base: u16) -> PathBuf {
    let seeds: Vec<String> = (0..n)
        .map(|j| format!("\"127.0.0.1:{}\"", base + j as u16))
        .collect();
    let text = format!(
        "cluster_address = \"127.0.0.1:{}\"\nclient_address = \"127.0.0.1:{}\"\nseed_nodes = [{}]\n\
         data_cores = 1\npin_cores = false\ndata_dir = \"{}\"\nnumber_of_shards = 100\n\
         [[entity_types]]\nname = \"echo\"\nkind = \"echo\"\nidle_timeout_ms = 0\n\
         [[entity_types]]\nname = \"counter\"\nkind = \"counter\"\nidle_timeout_ms = 0\n",
        base + i as u16,
        base + 100 + i as u16,
        seeds.join(", "),
        dir.join(format!("n{i}")).display()
    );
    let p = dir.join(format!("n{i}.toml"));
    std::fs::write(&p, text).expect("write config");
    p
}

fn start(bin: &str, cfg: &Path, cpu: Option<usize>) -> Proc {
    let mut cmd = match cpu {
        Some(c) => {
            let mut c2 = Command::new("taskset");
            c2.args(["-c", &c.to_string(), bin]);
            c2
        }
        None => Command::new(bin),
    };
    let mut child = cmd
        .args(["node", "--config"])
        .arg(cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn node");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("shardline: ready") => break,
            Some(Ok(_)) => {}
            _ => panic!("node exited before ready"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Proc(child)
}

fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat; `rest` starts at field 3.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn payload_for(t: &str) -> Vec<u8> {
    if t == "counter" {
        b"add 1".to_vec()
    } else {
        vec![b'x'; 32]
    }
}

fn print_hist(label: &str, h: &Histogram<u64>) {
    println!(
        "{label}: n={} p50={:.1}us p99={:.1}us p99.9={:.1}us max={:.1}us",
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.value_at_quantile(0.999) as f64 / 1000.0,
        h.max() as f64 / 1000.0
    );
}

fn single(args: &[String]) {
    let bin = arg(args, "--bin", "target/release/shardline");
    let t = arg(args, "--type", "echo");
    let conns: usize = arg(args, "--conns", "50").parse().expect("conns");
    let depth: usize = arg(args, "--depth", "1").parse().expect("depth");
    let secs: u64 = arg(args, "--secs", "5").parse().expect("secs");
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&bin, &config(dir.path(), 0, 1, 24_000), Some(0));
    let ids = core_affinity::get_core_ids().unwrap_or_default();
    if let Some(id) = ids.iter().find(|c| c.id == 1) {
        core_affinity::set_for_current(*id);
    }
    let addr: SocketAddr = "127.0.0.1:24100".parse().expect("addr");
    let pid = node.0.id();
    // Warm-up, then the measured run, both on one event-loop thread (like
    // redis-benchmark): each connection sends `depth` requests, waits for all
    // of them, and repeats.
    let _ = drive(addr, &t, conns, depth, Duration::from_secs(1));
    let c0 = cpu_ticks(pid);
    let t0 = Instant::now();
    let (h, n) = drive(addr, &t, conns, depth, Duration::from_secs(secs));
    let elapsed = t0.elapsed();
    let c1 = cpu_ticks(pid);
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_us = (c1 - c0) as f64 * 1e6 / tck / n.max(1) as f64;
    println!(
        "type={t} conns={conns} depth={depth}: {:.0} req/s, server cpu {:.2} us/req",
        n as f64 / elapsed.as_secs_f64(),
        cpu_us
    );
    print_hist("latency", &h);
}

fn cross(args: &[String]) {
    let bin = arg(args, "--bin", "target/release/shardline");
    let secs: u64 = arg(args, "--secs", "5").parse().expect("secs");
    let dir = tempfile::tempdir().expect("tmp");
    let _a = start(&bin, &config(dir.path(), 0, 2, 24_200), None);
    let _b = start(&bin, &config(dir.path(), 1, 2, 24_200), None);
    let addr_a: SocketAddr = "127.0.0.1:24300".parse().expect("addr");
    let mut c = Client::connect(addr_a).expect("connect");
    // Wait until both members are Up and the regions registered.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = c.node_status(Duration::from_secs(2)).expect("status");
        if st.members.iter().filter(|m| m.status == "Up").count() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "cluster did not form");
        std::thread::sleep(Duration::from_millis(200));
    }
    for i in 0..400 {
        c.ask("echo", &format!("x-{i}"), b"warm", Duration::from_secs(5))
            .expect("warm");
    }
    let st = c.node_status(Duration::from_secs(2)).expect("status");
    let local: std::collections::HashSet<String> = st
        .regions
        .iter()
        .filter(|r| r.type_name == "echo")
        .flat_map(|r| r.shards.values().flatten().cloned())
        .collect();
    let (loc, rem): (Vec<String>, Vec<String>) = (0..400)
        .map(|i| format!("x-{i}"))
        .partition(|id| local.contains(id));
    println!("entities homed on A: {}, on B: {}", loc.len(), rem.len());
    let mut hl = Histogram::<u64>::new_with_bounds(1_000, 10_000_000_000, 3).expect("hist");
    let mut hr = hl.clone();
    let end = Instant::now() + Duration::from_secs(secs);
    let mut i = 0;
    while Instant::now() < end {
        for (ids, h) in [(&loc, &mut hl), (&rem, &mut hr)] {
            if ids.is_empty() {
                continue;
            }
            let id = &ids[i % ids.len()];
            let t = Instant::now();
            let r = c
                .ask("echo", id, b"0123456789abcdef", Duration::from_secs(5))
                .expect("ask");
            assert_eq!(r.status, Status::Ok);
            let _ = h.record(t.elapsed().as_nanos() as u64);
        }
        i += 1;
    }
    print_hist("local (entity on A)", &hl);
    print_hist("remote (entity on B)", &hr);
    println!(
        "added by the cross-node hop: p50 +{:.1}us, p99 +{:.1}us",
        (hr.value_at_quantile(0.5) as f64 - hl.value_at_quantile(0.5) as f64) / 1000.0,
        (hr.value_at_quantile(0.99) as f64 - hl.value_at_quantile(0.99) as f64) / 1000.0
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("single") => single(&args),
        Some("cross") => cross(&args),
        _ => eprintln!("usage: loadgen single|cross [--bin PATH] [--type echo|counter] [--conns N] [--depth N] [--secs N]"),
    }
}

struct Conn {
    s: std::net::TcpStream,
    rbuf: Vec<u8>,
    sent_at: Instant,
    waiting: usize,
    next_id: u64,
}

/// Runs the batch-pipelined load for `dur` on one thread with poll(2).
fn drive(
    addr: SocketAddr,
    t: &str,
    conns: usize,
    depth: usize,
    dur: Duration,
) -> (Histogram<u64>, u64) {
    use shardline::envelope::{access, encode_frame, next_frame, ClientFrame, ServerFrame};
    let p = payload_for(t);
    let mut cs: Vec<Conn> = (0..conns)
        .map(|_| {
            let s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_nodelay(true).expect("nodelay");
            Conn {
                s,
                rbuf: Vec::with_capacity(1 << 16),
                sent_at: Instant::now(),
                waiting: 0,
                next_id: 0,
            }
        })
        .collect();
    let mut h = Histogram::<u64>::new_with_bounds(1_000, 10_000_000_000, 3).expect("hist");
    let mut n = 0u64;
    let mut out = Vec::with_capacity(1 << 16);
    let send_batch = |c: &mut Conn, ci: usize, out: &mut Vec<u8>| {
        out.clear();
        for _ in 0..depth {
            let f = ClientFrame::Request {
                request_id: c.next_id,
                type_name: t.as_bytes().to_vec(),
                entity_id: format!("{t}-{ci}-{}", c.next_id % 16).into_bytes(),
                payload: p.clone(),
            };
            c.next_id += 1;
            encode_frame(&f, out).expect("encode");
        }
        c.s.write_all(out).expect("write");
        c.sent_at = Instant::now();
        c.waiting = depth;
    };
    for (i, c) in cs.iter_mut().enumerate() {
        send_batch(c, i, &mut out);
    }
    let end = Instant::now() + dur;
    let mut fds: Vec<libc::pollfd> = cs
        .iter()
        .map(|c| libc::pollfd {
            fd: c.s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut buf = vec![0u8; 1 << 16];
    while Instant::now() < end {
        // SAFETY: fds is a valid array of pollfd of the given length.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if r <= 0 {
            continue;
        }
        for i in 0..fds.len() {
            if fds[i].revents == 0 {
                continue;
            }
            let c = &mut cs[i];
            let got = c.s.read(&mut buf).expect("read");
            assert!(got > 0, "server closed");
            c.rbuf.extend_from_slice(&buf[..got]);
            let mut pos = 0;
            while let Some(len) = next_frame(&c.rbuf[pos..], 1 << 24).expect("frame") {
                let a = access::<ServerFrame>(&c.rbuf[pos + 4..pos + 4 + len]).expect("valid");
                assert_eq!(a.status, 0, "status");
                let _ = h.record(c.sent_at.elapsed().as_nanos() as u64);
                n += 1;
                pos += 4 + len;
                c.waiting -= 1;
            }
            c.rbuf.drain(..pos);
            if c.waiting == 0 {
                send_batch(c, i, &mut out);
            }
        }
    }
    (h, n)
}
