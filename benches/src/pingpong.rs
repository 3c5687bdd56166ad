//! The latency floor: blocking TCP round trips between this process and a
//! child process of the same executable on loopback. Nothing a broker does
//! on a round trip can beat this; `latency-1k` is judged against it.
//!
//! The child is this executable run with this process's own arguments plus
//! the hidden `--echo-server` flag, so it works the same whether the
//! harness runs as `rotary bench` or as the `rotary-bench` binary.
//!
//! The round trip depends on where the scheduler puts the two ends: on one
//! core a wake-up is a context switch; across cores it is an inter-processor
//! interrupt, which on a virtual machine costs a VM exit. So besides the
//! unpinned figure (the floor the targets use) both placements are measured
//! with the two ends pinned.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::child::ChildGuard;
use crate::report::{self, PingpongFigures};
use crate::BenchArgs;
use anyhow::Context as _;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Largest `--pingpong-size`.
pub const MESSAGE_LEN_MAX: usize = 1 << 20;
/// How long the child may take to say which port it listens on.
const CHILD_START_TIMEOUT: Duration = Duration::from_secs(10);
/// A round trip slower than this means the child is gone or stuck.
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(5);
/// The echo server exits on its own this long after its expected end, in
/// case its parent died without stopping it.
const ECHO_LIFETIME_EXTRA: Duration = Duration::from_secs(60);

/// Where the two ends of the ping-pong run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Wherever the scheduler puts them.
    Unpinned,
    /// Both pinned to CPU 0.
    SameCore,
    /// Client pinned to CPU 0, echo server to CPU 1.
    CrossCore,
}

impl Placement {
    /// (client CPU, echo server CPU).
    fn cpus(self) -> Option<(usize, usize)> {
        match self {
            Placement::Unpinned => None,
            Placement::SameCore => Some((0, 0)),
            Placement::CrossCore => Some((0, 1)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Placement::Unpinned => "unpinned",
            Placement::SameCore => "same core",
            Placement::CrossCore => "cross core",
        }
    }
}

/// The child's side: listens on 127.0.0.1, prints the port on stdout,
/// echoes one connection until it closes.
pub fn serve_echo(args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(cpu) = args.echo_cpu {
        crate::sys::pin_current_thread(cpu).with_context(|| format!("pinning to CPU {cpu}"))?;
    }
    let lifetime = Duration::from_secs_f64(
        (args.duration_secs + args.warmup_secs).clamp(0.0, crate::DURATION_SECS_MAX * 2.0),
    ) + ECHO_LIFETIME_EXTRA;
    std::thread::spawn(move || {
        std::thread::sleep(lifetime);
        eprintln!("echo server: no end after {lifetime:?}; exiting");
        std::process::exit(1);
    });
    let listener = TcpListener::bind("127.0.0.1:0").context("echo server: bind")?;
    let port = listener.local_addr()?.port();
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{port}")?;
    stdout.flush()?;
    let (mut sock, _) = listener.accept().context("echo server: accept")?;
    sock.set_nodelay(true)?;
    if !args.echo_relay_to.is_empty() {
        return relay(args, sock);
    }
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = sock.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        sock.write_all(&buf[..n])?;
    }
}

/// The relaying echo server's loop: each message of `--echo-relay-bytes`
/// from `up` goes to every peer, and back up once every peer echoed it, as
/// a primary sends an append to its replicas and answers once all acked.
fn relay(args: &BenchArgs, mut up: TcpStream) -> anyhow::Result<()> {
    let mut peers = Vec::new();
    for &port in &args.echo_relay_to {
        let s = TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("relay: connecting to the echo server at port {port}"))?;
        s.set_nodelay(true)?;
        peers.push(s);
    }
    let mut msg = vec![0u8; args.echo_relay_bytes];
    let mut back = vec![0u8; args.echo_relay_bytes];
    loop {
        match up.read_exact(&mut msg) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e).context("relay: reading a message"),
        }
        for p in &mut peers {
            p.write_all(&msg).context("relay: sending to a peer")?;
        }
        for p in &mut peers {
            p.read_exact(&mut back)
                .context("relay: reading a peer's echo")?;
            anyhow::ensure!(back == msg, "relay: a peer's echo differs from the message");
        }
        up.write_all(&msg).context("relay: answering")?;
    }
}

/// An echo server child pinned to `cpu` (if any) with `extra` arguments,
/// and the port it listens on.
pub(crate) fn spawn_echo(
    cpu: Option<usize>,
    extra: &[String],
) -> anyhow::Result<(ChildGuard, u16)> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut cmd = Command::new(&exe);
    cmd.args(std::env::args_os().skip(1)).arg("--echo-server");
    if let Some(cpu) = cpu {
        cmd.arg(format!("--echo-cpu={cpu}"));
    }
    cmd.args(extra);
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {} --echo-server", exe.display()))?;
    let mut child = ChildGuard(child);
    let stdout = child.0.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let r = BufReader::new(stdout).read_line(&mut line).map(|_| line);
        let _ = tx.send(r);
    });
    let line = rx
        .recv_timeout(CHILD_START_TIMEOUT)
        .context("echo server did not start")?
        .context("reading the echo server's port")?;
    let port: u16 = line
        .trim()
        .parse()
        .with_context(|| format!("echo server printed {line:?}, not a port"))?;
    Ok((child, port))
}

/// Measures round trips of `--pingpong-size` bytes for `--duration`.
pub fn run(args: &BenchArgs, placement: Placement) -> anyhow::Result<PingpongFigures> {
    let (child, port) = spawn_echo(placement.cpus().map(|(_, server)| server), &[])?;
    let rtt = std::thread::scope(|scope| {
        scope
            .spawn(|| round_trips(args, port, placement))
            .join()
            .expect("ping-pong thread panicked")
    })?;
    drop(child);
    Ok(PingpongFigures {
        placement: placement.name().into(),
        message_bytes: args.pingpong_size,
        seconds: args.duration_secs,
        round_trips: rtt.len(),
        rtt: report::Percentiles::of(&rtt),
    })
}

/// The client's side, on a thread of its own so that pinning it leaves the
/// rest of the process alone.
fn round_trips(
    args: &BenchArgs,
    port: u16,
    placement: Placement,
) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    if let Some((client_cpu, _)) = placement.cpus() {
        crate::sys::pin_current_thread(client_cpu)
            .with_context(|| format!("pinning to CPU {client_cpu}"))?;
    }
    exchange(args, port, args.pingpong_size, None)
}

/// Round trips of `bytes` to the echo server at `port`, one at a time, for
/// the warm-up and then `--duration`, each timed from its send and
/// recorded once the warm-up is over: back to back, or with `gap` between
/// intended sends (at once after a late answer).
fn exchange(
    args: &BenchArgs,
    port: u16,
    bytes: usize,
    gap: Option<Duration>,
) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    let mut sock = TcpStream::connect(("127.0.0.1", port)).context("connecting to echo server")?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(ROUND_TRIP_TIMEOUT))?;
    sock.set_write_timeout(Some(ROUND_TRIP_TIMEOUT))?;
    let message: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut back = vec![0u8; bytes];
    let mut rtt = report::histogram();
    let start = Instant::now();
    let measure_from = start + args.warmup();
    let end = measure_from + args.duration();
    let mut intended = start;
    loop {
        if let Some(gap) = gap {
            let now = Instant::now();
            if intended > now {
                std::thread::sleep(intended - now);
            }
            intended += gap;
        }
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        sock.write_all(&message).context("round trip: send")?;
        sock.read_exact(&mut back).context("round trip: answer")?;
        if sent >= measure_from {
            report::record(&mut rtt, sent.elapsed());
        }
        anyhow::ensure!(back == message, "echo differs from the message sent");
    }
    Ok(rtt)
}

/// [`exchange`] at `rate` round trips per second, from a thread pinned to
/// `cpus` (none: unpinned) with precise sleeps.
pub(crate) fn paced_round_trips(
    args: &BenchArgs,
    port: u16,
    rate: u64,
    bytes: usize,
    cpus: &[usize],
) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                if !cpus.is_empty() {
                    crate::sys::pin_current_thread_to(cpus)
                        .with_context(|| format!("pinning to CPUs {cpus:?}"))?;
                }
                if let Err(e) = crate::sys::precise_sleeps() {
                    eprintln!("warning: PR_SET_TIMERSLACK: {e}");
                }
                let gap = Duration::from_nanos(1_000_000_000 / rate.max(1));
                exchange(args, port, bytes, Some(gap))
            })
            .join()
            .expect("round-trip thread panicked")
    })
}
