//! A throwaway PostgreSQL server for one test: `initdb` into a temp dir
//! (as the `postgres` user when the test runs as root), started on a free
//! 127.0.0.1 port with its socket in the temp dir, stopped on drop.
//!
//! The server binaries are found in `$SHARDLINE_PG_BIN`, else in the
//! newest `/usr/lib/postgresql/*/bin`, else through `pg_config --bindir`;
//! `.ci/run` installs the Debian package when none is there.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One running (or stopped) throwaway server.
pub struct TempPg {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    /// `fsync = off` (tests that never crash the database itself).
    fast: bool,
}

/// The directory of `initdb` and `postgres`.
pub fn pg_bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("SHARDLINE_PG_BIN") {
        return PathBuf::from(d);
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let b = e.path().join("bin");
            b.join("initdb").exists().then_some((v, b))
        })
        .collect();
    found.sort();
    if let Some((_, b)) = found.pop() {
        return b;
    }
    let out = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("PostgreSQL server binaries not found: install postgresql (see .ci/run) or set SHARDLINE_PG_BIN");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `cmd` as the `postgres` user when running as root (initdb and the
/// server refuse root), else as is.
fn as_pg(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl TempPg {
    /// Creates and starts a server with `fsync = off` (fast; the tests
    /// crash nodes, never the database's machine).
    pub fn start() -> TempPg {
        Self::start_with(true)
    }

    /// Creates and starts a server; `fast = false` keeps PostgreSQL's
    /// default durability settings (for benchmarks).
    pub fn start_with(fast: bool) -> TempPg {
        let dir = tempfile::Builder::new()
            .prefix("shardline-pg-")
            .tempdir()
            .expect("tempdir");
        if is_root() {
            let c = std::ffi::CString::new(dir.path().as_os_str().to_string_lossy().as_bytes())
                .expect("path");
            let out = Command::new("id")
                .args(["-u", "postgres"])
                .output()
                .expect("id -u postgres");
            let uid: u32 = String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .expect("the postgres user exists (install postgresql)");
            let out = Command::new("id")
                .args(["-g", "postgres"])
                .output()
                .expect("id -g postgres");
            let gid: u32 = String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .expect("postgres group");
            // SAFETY: chown(2) on a path we created.
            let rc = unsafe { libc::chown(c.as_ptr(), uid, gid) };
            assert_eq!(rc, 0, "chown the database's temp dir");
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            // Every parent must be traversable by `postgres`.
            let mut p = dir.path().parent();
            while let Some(d) = p {
                if let Ok(m) = std::fs::metadata(d) {
                    let mode = m.permissions().mode();
                    if mode & 0o001 == 0 {
                        let _ = std::fs::set_permissions(
                            d,
                            std::fs::Permissions::from_mode(mode | 0o011),
                        );
                    }
                }
                p = d.parent();
            }
        }
        let bin = pg_bin_dir();
        let data = dir.path().join("data");
        let out = as_pg(&bin.join("initdb"))
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "-D",
            ])
            .arg(&data)
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = TempPg {
            dir,
            bin,
            port: free_port(),
            child: None,
            fast,
        };
        pg.start_server();
        pg
    }

    /// The connection URL for `journal.url`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts the server (again) on the same port and data, waiting
    /// (bounded) until it accepts connections.
    pub fn start_server(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .expect("server log");
        let mut cmd = as_pg(&self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
                // Commit times of rows (`pg_xact_commit_timestamp`), for
                // the fencing tests' ordering checks.
                "-c",
                "track_commit_timestamp=on",
            ]);
        if self.fast {
            cmd.args(["-c", "fsync=off", "-c", "full_page_writes=off"]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-t", "1"])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("postgres exited ({st}): {}", self.server_log());
            }
            assert!(
                Instant::now() < deadline,
                "postgres not ready in 30 s: {}",
                self.server_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (fast shutdown: open transactions are rolled back,
    /// clients disconnected), bounded; kills it if it does not stop.
    pub fn stop_server(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The server's log.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Runs one SQL command with `psql` and returns its unaligned output.
    pub fn psql(&self, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-c",
                sql,
            ])
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for TempPg {
    fn drop(&mut self) {
        self.stop_server();
    }
}
