//! rotary's HTTP front door: Prometheus metrics (`/metrics`), health probes
//! (`/healthz`, `/readyz`) and a journal gateway compatible with Gazette's
//! (`GET`/`HEAD`/`PUT /<journal>`).
//!
//! It runs on threads of its own, a small tokio runtime started by
//! [`HttpServer::start`], never on a shard's thread. The gateway talks to
//! the broker's shards as any client does, through the native protocol on
//! loopback ([`rotary_net::client::Client`]): an HTTP client that is slow to
//! send or to read holds only this runtime's buffers and tasks, and the
//! shards see a native client that keeps up. `/metrics` reads the broker's
//! shared counters with relaxed loads ([`rotary_engine::Observed`]).
//!
//! Limits: [`HttpConfig::connections_max`] open connections (more are closed
//! at once), [`HttpConfig::body_limit_bytes`] per PUT (413 beyond), and
//! [`HttpConfig::timeout`] for a request's headers to arrive and between
//! the pieces of its body (a slow-loris client is cut off).

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

mod body;
mod exporter;
pub mod gateway;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use hyper::{Method, Request, Response, StatusCode};

pub use body::Body;

/// How the HTTP server runs.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// Largest PUT body; larger ones are answered 413 and appended nowhere.
    pub body_limit_bytes: u64,
    /// How long a request's headers may take to arrive, and how long its
    /// body may send nothing before the request is answered 408.
    pub timeout: Duration,
    /// Journals (a label selector) that get series of their own on
    /// `/metrics`; `None`: none.
    pub metrics_journals: Option<String>,
    /// Open connections at most; further ones are closed unserved.
    pub connections_max: usize,
    /// Threads of the server's runtime.
    pub threads: usize,
}

/// [`HttpConfig::body_limit_bytes`] by default.
pub const BODY_LIMIT_DEFAULT: u64 = 64 << 20;
/// [`HttpConfig::timeout`] by default.
pub const TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// [`HttpConfig::connections_max`] by default.
pub const CONNECTIONS_MAX_DEFAULT: usize = 4096;
/// Journals at most that `--metrics-journals` gives series of their own;
/// beyond, the first ones by name (and a warning in the log).
pub const METRICS_JOURNALS_MAX: usize = 10_000;

impl HttpConfig {
    pub fn new(listen: SocketAddr) -> Self {
        HttpConfig {
            listen,
            body_limit_bytes: BODY_LIMIT_DEFAULT,
            timeout: TIMEOUT_DEFAULT,
            metrics_journals: None,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            threads: 2,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("HTTP listener {0}: {1}")]
    Listen(SocketAddr, #[source] std::io::Error),
    #[error("HTTP server runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

impl HttpError {
    /// The listen address is taken by another process.
    pub fn is_addr_in_use(&self) -> bool {
        matches!(self, HttpError::Listen(_, e) if e.kind() == std::io::ErrorKind::AddrInUse)
    }
}

/// The broker as the server reaches it once it has started.
pub(crate) struct Backend {
    pub observed: rotary_engine::Observed,
    pub client: rotary_net::client::Client,
}

/// Shared by every connection of the server.
pub(crate) struct State {
    pub config: HttpConfig,
    pub backend: OnceLock<Backend>,
    /// Recovery finished, listeners up, gateway client connected.
    pub ready: AtomicBool,
    /// Every journal's stores were listed once: see [`readiness`].
    pub listed: AtomicBool,
    /// A stop was asked for: not ready any more.
    pub stopping: AtomicBool,
    pub open_connections: AtomicI64,
    pub http: exporter::HttpMetrics,
}

/// A running HTTP server.
pub struct HttpServer {
    state: Arc<State>,
    handle: tokio::runtime::Handle,
    local_addr: SocketAddr,
}

impl HttpServer {
    /// Binds the listener and starts serving on threads of the server's
    /// own. Until [`HttpServer::started`], `/healthz` answers, `/readyz`
    /// says not ready and the gateway answers 503.
    pub fn start(config: HttpConfig) -> Result<HttpServer, HttpError> {
        let listener = std::net::TcpListener::bind(config.listen)
            .map_err(|e| HttpError::Listen(config.listen, e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| HttpError::Listen(config.listen, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| HttpError::Listen(config.listen, e))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("rotary-http")
            .enable_all()
            .build()
            .map_err(HttpError::Runtime)?;
        let handle = rt.handle().clone();
        let state = Arc::new(State {
            config,
            backend: OnceLock::new(),
            ready: AtomicBool::new(false),
            listed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            open_connections: AtomicI64::new(0),
            http: exporter::HttpMetrics::default(),
        });
        let listener = {
            let _guard = rt.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|e| HttpError::Listen(local_addr, e))?
        };
        let serving = state.clone();
        std::thread::Builder::new()
            .name("rotary-http-accept".into())
            .spawn(move || rt.block_on(accept_loop(listener, serving)))
            .map_err(HttpError::Runtime)?;
        tracing::info!(http = %local_addr, "HTTP listener up (/metrics, /healthz, /readyz, gateway)");
        Ok(HttpServer {
            state,
            handle,
            local_addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The broker recovered and listens: connects the gateway's client to
    /// it and then reports ready.
    pub fn started(&self, broker: &rotary_engine::Broker) {
        let observed = broker.observed();
        let mut endpoint = broker.endpoints[0];
        if endpoint.ip().is_unspecified() {
            endpoint.set_ip(match endpoint {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let state = self.state.clone();
        self.handle.spawn(async move {
            let endpoint = endpoint.to_string();
            let mut wait = Duration::from_millis(50);
            let client = loop {
                match rotary_net::client::Client::connect(&endpoint).await {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::warn!(error = %e, %endpoint, "HTTP gateway cannot reach the broker yet");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(2));
                    }
                }
            };
            let _ = state.backend.set(Backend { observed, client });
            state.ready.store(true, Ordering::Release);
        });
    }

    /// The broker is stopping: `/readyz` says so, so that load balancers
    /// stop sending it traffic while it drains.
    pub fn stopping(&self) {
        self.state.stopping.store(true, Ordering::Release);
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, state: Arc<State>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(state.config.connections_max));
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if warned
                    .is_none_or(|t| rotary_engine::clock::elapsed(t) >= Duration::from_secs(10))
                {
                    tracing::warn!(error = %e, "HTTP accept failed");
                    warned = Some(rotary_engine::clock::now());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Over the limit: the client sees a close and may retry.
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            state.open_connections.fetch_add(1, Ordering::Relaxed);
            let service_state = state.clone();
            let service = hyper::service::service_fn(move |req| {
                let state = service_state.clone();
                async move { Ok::<_, Infallible>(route(state, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(state.config.timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
            state.open_connections.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
}

/// Answers one request.
async fn route(state: Arc<State>, req: Request<hyper::body::Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let response = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/healthz") => text(StatusCode::OK, "ok"),
        (&Method::GET | &Method::HEAD, "/readyz") => readyz(&state),
        (&Method::GET, "/metrics") => {
            exporter::scrape(&state, req.headers().get(hyper::header::ACCEPT)).await
        }
        (_, "/healthz" | "/readyz" | "/metrics") => {
            let mut r = text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{} is not allowed here; use GET", req.method()),
            );
            r.headers_mut()
                .insert(hyper::header::ALLOW, "GET, HEAD".parse().expect("header"));
            r
        }
        _ => gateway::serve(&state, req).await,
    };
    state.http.count(&method, response.status());
    response
}

fn readyz(state: &State) -> Response<Body> {
    match readiness(state) {
        Ok(()) => text(StatusCode::OK, "ready"),
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

/// Whether the broker is ready, else why not: it recovered its journals,
/// listens, and has listed the stores of every journal with stores once
/// since it started (after which journals created later, whose first
/// listing is quick to come, do not make it unready again).
pub(crate) fn readiness(state: &State) -> Result<(), String> {
    if state.stopping.load(Ordering::Acquire) {
        return Err("stopping".into());
    }
    let backend = state.backend.get();
    let (true, Some(backend)) = (state.ready.load(Ordering::Acquire), backend) else {
        return Err("recovering journals".into());
    };
    if state.listed.load(Ordering::Acquire) {
        return Ok(());
    }
    match backend
        .observed
        .metrics
        .journals_unlisted
        .load(Ordering::Relaxed)
    {
        0 => {
            state.listed.store(true, Ordering::Release);
            Ok(())
        }
        n => Err(format!(
            "the stores of {n} journal(s) are not yet listed (see rotary_journals_unlisted)"
        )),
    }
}

/// A response with a one-line plain-text body.
pub(crate) fn text(status: StatusCode, line: impl std::fmt::Display) -> Response<Body> {
    let mut line = line.to_string().replace(['\r', '\n'], " ");
    line.push('\n');
    let mut r = Response::new(Body::full(Bytes::from(line)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "text/plain; charset=utf-8".parse().expect("header"),
    );
    r
}
