//! A real etcd for tests: started on free loopback ports with a temporary
//! data directory, stopped and started again on the same ports and data,
//! killed by PID when dropped.
//!
//! The binary is `$ROTARY_ETCD`, else `etcd` on `PATH`, else
//! `/usr/bin/etcd` (Debian's `etcd-server`). Synchronous, so any test can
//! use it, with or without a runtime.
#![allow(clippy::disallowed_methods)] // A real etcd process, waited for in real time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd may take to serve after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long etcd may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Fresh port pairs to try when etcd cannot bind the ones picked.
const START_ATTEMPTS_MAX: u32 = 3;

/// Why the harness could not run etcd.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// No etcd binary anywhere.
    #[error("no etcd binary: install Debian's etcd-server (apt-get install etcd-server) or set ROTARY_ETCD=/path/to/etcd")]
    NotInstalled,
    /// An OS call failed.
    #[error("etcd harness: {what}: {source}")]
    Io {
        /// What the harness was doing.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// etcd exited or did not serve in time.
    #[error("etcd did not start ({why}); its log ends with:\n{log_tail}")]
    DidNotStart {
        /// What was seen.
        why: &'static str,
        /// The end of etcd's output.
        log_tail: String,
    },
}

/// A running (or stopped) etcd, owned by a test.
#[derive(Debug)]
pub struct Etcd {
    binary: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// The etcd binary the harness would run, or `None`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ROTARY_ETCD") {
        return Some(PathBuf::from(path));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("etcd"))
            .find(|candidate| candidate.is_file())
    });
    on_path.or_else(|| {
        let debian = PathBuf::from("/usr/bin/etcd");
        debian.is_file().then_some(debian)
    })
}

fn free_port() -> Result<u16, HarnessError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|source| HarnessError::Io {
        what: "binding a free port",
        source,
    })?;
    let port = listener.local_addr().map_err(|source| HarnessError::Io {
        what: "reading a bound port",
        source,
    })?;
    Ok(port.port())
}

impl Etcd {
    /// Starts etcd and waits until it serves.
    pub fn start() -> Result<Etcd, HarnessError> {
        let binary = etcd_binary().ok_or(HarnessError::NotInstalled)?;
        let dir = tempfile::Builder::new()
            .prefix("rotary-etcd-")
            .tempdir()
            .map_err(|source| HarnessError::Io {
                what: "creating the data directory",
                source,
            })?;
        let mut etcd = Etcd {
            binary,
            dir,
            client_port: 0,
            peer_port: 0,
            child: None,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            etcd.client_port = free_port()?;
            etcd.peer_port = free_port()?;
            match etcd.restart() {
                Ok(()) => return Ok(etcd),
                // Another process may have taken a port between our probe
                // and etcd's bind: try other ports on a fresh data dir.
                Err(HarnessError::DidNotStart { .. }) if attempt < START_ATTEMPTS_MAX => {
                    let _ = std::fs::remove_dir_all(etcd.data_dir());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client address.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    /// etcd's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is running (it may be paused).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Starts etcd again after [`Etcd::stop`], on the same ports and data.
    /// Does nothing if it is running.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|source| HarnessError::Io {
                what: "opening the log",
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| HarnessError::Io {
            what: "opening the log",
            source,
        })?;
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&self.binary)
            .arg("--name=rotary-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=rotary-test={peer_url}"))
            .arg("--initial-cluster-state=new")
            .env_remove("ETCDCTL_API")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|source| HarnessError::Io {
                what: "spawning etcd",
                source,
            })?;
        self.child = Some(child);
        self.wait_serving()
    }

    fn wait_serving(&mut self) -> Result<(), HarnessError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("started");
            if let Ok(Some(_status)) = child.try_wait() {
                self.child = None;
                return Err(HarnessError::DidNotStart {
                    why: "it exited",
                    log_tail: log_tail(&self.log_path()),
                });
            }
            if healthy(self.client_addr()) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(HarnessError::DidNotStart {
                    why: "not healthy within 30 s",
                    log_tail: log_tail(&self.log_path()),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops etcd: SIGTERM, then SIGKILL if it has not exited within 10 s.
    /// Its data stays for [`Etcd::restart`].
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        signal(&child, libc::SIGCONT);
        signal(&child, libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Kills etcd at once (SIGKILL), as a crash would. Data stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Pauses etcd (SIGSTOP): it keeps its sockets but answers nothing.
    pub fn pause(&self) {
        if let Some(child) = &self.child {
            signal(child, libc::SIGSTOP);
        }
    }

    /// Resumes a paused etcd (SIGCONT).
    pub fn resume(&self) {
        if let Some(child) = &self.child {
            signal(child, libc::SIGCONT);
        }
    }

    /// The end of etcd's log, for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path())
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

#[allow(unsafe_code)]
fn signal(child: &Child, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    // The PID is our own unreaped child's, so it cannot name another process.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Whether etcd answers `GET /health` with a healthy status (it does once
/// it has a leader and serves requests).
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200") && response.contains("\"health\":\"true\"")
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
