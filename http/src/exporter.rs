//! `/metrics`: the broker's counters in the Prometheus text format, encoded
//! by `prometheus-client`.
//!
//! Series, all prefixed `rotary_`:
//! - every STATS counter, per shard (label `shard`; work done off the
//!   shards' threads, if any, under `shard="other"`): `sum by` the label
//!   gives STATS's broker-wide value;
//! - the append latency histogram, per shard and durability;
//! - the uploader's counters (uploads, bytes, failures, latency, queue),
//!   and per store (label `store`: an S3 store's bucket, a file store's
//!   directory) upload and listing latency histograms and error counts;
//! - the spec count and digest, disk free and each shard's commit log size;
//! - the gateway's own: requests by method and status, PUT latency,
//!   bytes streamed to GETs;
//! - with `--metrics-journals SELECTOR`, each selected journal's write head.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::{Method, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::{text, Body, State, METRICS_JOURNALS_MAX};

type Labels = Vec<(&'static str, String)>;

/// The gateway's own metrics, kept across scrapes.
#[derive(Clone)]
pub(crate) struct HttpMetrics {
    requests: Family<Labels, Counter>,
    put_seconds: Histogram,
    pub read_bytes: Counter,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            requests: Family::default(),
            // 50 µs to about 3 s.
            put_seconds: Histogram::new(exponential_buckets(50e-6, 2.0, 17)),
            read_bytes: Counter::default(),
        }
    }
}

impl HttpMetrics {
    pub fn count(&self, method: &Method, status: StatusCode) {
        self.requests
            .get_or_create(&vec![
                ("method", method.as_str().to_string()),
                ("code", status.as_u16().to_string()),
            ])
            .inc();
    }

    pub fn observe_put(&self, took: Duration) {
        self.put_seconds.observe(took.as_secs_f64());
    }
}

/// What a scrape found that needs asking the broker (async), gathered
/// before encoding.
#[derive(Debug, Default)]
struct Gathered {
    /// `(journal, write head)` of the journals `--metrics-journals` selects.
    journals: Vec<(String, u64)>,
}

/// The broker's counters, read as the scrape encodes them.
struct BrokerCollector {
    state: Arc<State>,
    gathered: Gathered,
}

impl std::fmt::Debug for BrokerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerCollector").finish()
    }
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for BrokerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ready = crate::readiness(&self.state).is_ok();
        gauge(
            &mut encoder,
            "rotary_ready",
            "1 once the broker recovered its journals, serves and listed every journal's stores once (as /readyz), 0 before and while it stops",
            ready as i64,
        )?;
        gauge(
            &mut encoder,
            "rotary_http_open_connections",
            "Open connections to the HTTP listener",
            self.state.open_connections.load(Ordering::Relaxed),
        )?;
        let Some(backend) = self.state.backend.get() else {
            return Ok(());
        };
        let o = &backend.observed;
        gauge(
            &mut encoder,
            "rotary_shards",
            "Shards (cores) the broker runs",
            o.shards as i64,
        )?;
        shard_metrics(&mut encoder, o)?;
        append_latency(&mut encoder, o)?;
        stores(&mut encoder, &o.uploader)?;
        upload_metrics(&mut encoder, &o.uploader)?;
        specs_and_disk(&mut encoder, o)?;
        journal_heads(&mut encoder, &self.gathered)
    }
}

/// Every STATS counter, per shard.
fn shard_metrics(
    encoder: &mut DescriptorEncoder,
    o: &rotary_engine::Observed,
) -> Result<(), std::fmt::Error> {
    for (d, c) in o.metrics.described() {
        let name = format!("rotary_{}", d.name);
        let kind = match d.kind {
            rotary_engine::metrics::Kind::Counter => MetricType::Counter,
            rotary_engine::metrics::Kind::Gauge => MetricType::Gauge,
        };
        let help = one_line_help(d.help);
        let mut family = encoder.encode_descriptor(&name, &help, None, kind)?;
        let other = c.slot(rotary_engine::metrics::OTHER_SLOT);
        let slots = (0..o.shards)
            .map(|s| (s.to_string(), c.slot(s)))
            .chain((other != 0).then(|| ("other".to_string(), other)));
        for (shard, v) in slots {
            let labels = [("shard", shard)];
            let mut m = family.encode_family(&labels)?;
            match d.kind {
                rotary_engine::metrics::Kind::Counter => {
                    m.encode_counter::<NoLabelSet, _, u64>(&v, None)?
                }
                // A gauge's slot may have wrapped below zero.
                rotary_engine::metrics::Kind::Gauge => m.encode_gauge(&(v as i64))?,
            }
        }
    }
    Ok(())
}

/// The uploader's counters and queue.
fn upload_metrics(
    encoder: &mut DescriptorEncoder,
    uploader: &rotary_uploader::Uploader,
) -> Result<(), std::fmt::Error> {
    let u = uploader.metrics();
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    for (name, help, v) in [
        (
            "rotary_uploads",
            "Sealed fragments uploaded to their stores (written and verified)",
            load(&u.uploads),
        ),
        (
            "rotary_upload_failures",
            "Uploads that failed after their attempts",
            load(&u.upload_failures),
        ),
        (
            "rotary_upload_retries",
            "Upload attempts that failed and were tried again",
            load(&u.upload_retries),
        ),
        (
            "rotary_upload_bytes",
            "Uncompressed bytes of uploaded fragments",
            load(&u.upload_bytes),
        ),
        (
            "rotary_upload_stored_bytes",
            "Bytes of uploaded fragments as stored (compressed)",
            load(&u.upload_stored_bytes),
        ),
        (
            "rotary_upload_skipped_existing",
            "Uploads skipped because the store already held the object",
            load(&u.skipped_existing),
        ),
    ] {
        counter(encoder, name, help, v)?;
    }
    let seconds = ConstCounter::new(load(&u.upload_micros) as f64 / 1e6);
    seconds.encode(encoder.encode_descriptor(
        "rotary_upload_seconds",
        "Time spent uploading fragments (with rotary_uploads_total, the mean latency)",
        None,
        MetricType::Counter,
    )?)?;
    gauge(
        encoder,
        "rotary_upload_queue_depth",
        "Sealed fragments queued for upload, not yet started (STATS upload_queue_depth)",
        load(&u.queued) as i64,
    )?;
    gauge(
        encoder,
        "rotary_fragments_awaiting_upload",
        "Sealed fragments queued for upload or being uploaded",
        (load(&u.queued) + load(&u.in_flight)) as i64,
    )?;
    Ok(())
}

/// The spec count and digest, disk free and each shard's commit log size.
fn specs_and_disk(
    encoder: &mut DescriptorEncoder,
    o: &rotary_engine::Observed,
) -> Result<(), std::fmt::Error> {
    let (specs, digest) = o.specs.digest();
    gauge(
        encoder,
        "rotary_specs",
        "Journal specs the broker holds",
        specs as i64,
    )?;
    // An info metric as a gauge of 1: the Prometheus text format, which
    // promtool checks, has no info type.
    encoder
        .encode_descriptor(
            "rotary_specs_digest_info",
            "Digest of the broker's journal specs (equal on brokers that agree), as its label",
            None,
            MetricType::Gauge,
        )?
        .encode_family(&[("digest", format!("{digest:032x}"))])?
        .encode_gauge(&1i64)?;
    if let Ok(free) = rotary_storage::spool::free_bytes_at(&o.data_dir) {
        gauge(
            encoder,
            "rotary_disk_free_bytes",
            "Free bytes on the data directory's file system",
            free.min(i64::MAX as u64) as i64,
        )?;
    }
    let mut logs = encoder.encode_descriptor(
        "rotary_commit_log_bytes",
        "Size of each shard's commit log",
        None,
        MetricType::Gauge,
    )?;
    for s in 0..o.shards {
        let path = rotary_storage::wal::CommitLog::path_in(&o.data_dir.join(format!("shard-{s}")));
        if let Ok(m) = std::fs::metadata(&path) {
            logs.encode_family(&[("shard", s.to_string())])?
                .encode_gauge(&(m.len().min(i64::MAX as u64) as i64))?;
        }
    }
    Ok(())
}

/// The write heads of the journals `--metrics-journals` selects.
fn journal_heads(
    encoder: &mut DescriptorEncoder,
    gathered: &Gathered,
) -> Result<(), std::fmt::Error> {
    if !gathered.journals.is_empty() {
        let mut heads = encoder.encode_descriptor(
            "rotary_journal_write_head_bytes",
            "Write head of each journal selected by --metrics-journals (rate() is its append throughput)",
            None,
            MetricType::Gauge,
        )?;
        for (journal, head) in &gathered.journals {
            heads
                .encode_family(&[("journal", journal.clone())])?
                .encode_gauge(&(*head as i64))?;
        }
    }
    Ok(())
}

/// A histogram's buckets for `encode_histogram`: upper bounds in seconds
/// (the last one `+Inf`) and counts, not cumulative.
fn buckets_of(bounds_micros: &[u64], counts: &[u64]) -> Vec<(f64, u64)> {
    assert_eq!(bounds_micros.len() + 1, counts.len());
    bounds_micros
        .iter()
        .map(|&b| b as f64 / 1e6)
        .chain(std::iter::once(f64::MAX))
        .zip(counts.iter().copied())
        .collect()
}

/// `rotary_append_latency_seconds`, per shard and durability.
fn append_latency(
    encoder: &mut DescriptorEncoder,
    o: &rotary_engine::Observed,
) -> Result<(), std::fmt::Error> {
    use rotary_engine::metrics::{DURABILITIES, LATENCY_BOUNDS_MICROS, OTHER_SLOT};
    let h = &o.metrics.append_latency;
    let mut family = encoder.encode_descriptor(
        "rotary_append_latency_seconds",
        "Latency of appends acknowledged OK, from their arrival at the broker to their acknowledgement, by the journal's durability",
        None,
        MetricType::Histogram,
    )?;
    for (class, durability) in DURABILITIES.iter().enumerate() {
        let other = h.slot(OTHER_SLOT, class);
        let slots = (0..o.shards)
            .map(|s| (s.to_string(), h.slot(s, class)))
            .chain((other.count() != 0).then(|| ("other".to_string(), other)));
        for (shard, snap) in slots {
            let labels = [("shard", shard), ("durability", durability.to_string())];
            family
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(
                    snap.sum_micros as f64 / 1e6,
                    snap.count(),
                    &buckets_of(&LATENCY_BOUNDS_MICROS, &snap.buckets),
                    None,
                )?;
        }
    }
    Ok(())
}

/// Each store's upload and listing latencies and errors, by store label.
fn stores(
    encoder: &mut DescriptorEncoder,
    uploader: &rotary_uploader::Uploader,
) -> Result<(), std::fmt::Error> {
    use rotary_uploader::stats::{Histogram as StoreHistogram, StoreStats, STORE_BOUNDS_MICROS};
    let stores = uploader.stores_stats().snapshot();
    if stores.is_empty() {
        return Ok(());
    }
    type Pick = fn(&StoreStats) -> &StoreHistogram;
    let histograms: [(&str, &str, Pick); 2] = [
        (
            "rotary_store_upload_seconds",
            "Latency of uploads that wrote a fragment to the store, attempts and verification included",
            |s| &s.uploads,
        ),
        (
            "rotary_store_listing_seconds",
            "Duration of listings of a journal's fragments in the store, failed ones included",
            |s| &s.listings,
        ),
    ];
    for (name, help, pick) in histograms {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
        for (store, s) in &stores {
            let (counts, sum_micros) = pick(s).snapshot();
            family
                .encode_family(&[("store", store.clone())])?
                .encode_histogram::<NoLabelSet>(
                    sum_micros as f64 / 1e6,
                    counts.iter().sum(),
                    &buckets_of(&STORE_BOUNDS_MICROS, &counts),
                    None,
                )?;
        }
    }
    type Count = fn(&StoreStats) -> &std::sync::atomic::AtomicU64;
    let counters: [(&str, &str, Count); 2] = [
        (
            "rotary_store_upload_errors",
            "Upload attempts to the store that failed (retried or not)",
            |s| &s.upload_errors,
        ),
        (
            "rotary_store_listing_errors",
            "Listings of a journal's fragments in the store that failed",
            |s| &s.listing_errors,
        ),
    ];
    for (name, help, pick) in counters {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (store, s) in &stores {
            let v = pick(s).load(Ordering::Relaxed);
            family
                .encode_family(&[("store", store.clone())])?
                .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
        }
    }
    Ok(())
}

/// Doc comments as help text: one line, without the final period that the
/// encoder adds.
fn one_line_help(doc: &str) -> String {
    let joined = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    joined.trim_end_matches('.').to_string()
}

/// Asks the broker for the selected journals' write heads.
async fn gather(state: &State) -> Gathered {
    let mut g = Gathered::default();
    let (Some(selector), Some(backend)) = (&state.config.metrics_journals, state.backend.get())
    else {
        return g;
    };
    let client = &backend.client;
    let journals = match client.list(selector).await {
        Ok(j) => j,
        Err(e) => {
            tracing::warn!(error = %e, "--metrics-journals: listing journals failed");
            return g;
        }
    };
    if journals.len() > METRICS_JOURNALS_MAX {
        tracing::warn!(
            selected = journals.len(),
            max = METRICS_JOURNALS_MAX,
            "--metrics-journals selects too many journals; exporting the first ones"
        );
    }
    let mut names: Vec<String> = journals.into_iter().map(|j| j.spec.name).collect();
    names.sort();
    names.truncate(METRICS_JOURNALS_MAX);
    let mut tasks = tokio::task::JoinSet::new();
    for name in names {
        let client = client.clone();
        tasks.spawn(async move {
            let req = rotary_net::wire::ReadRequest {
                journal: name.clone(),
                offset: None,
                end_offset: None,
                route_revision: 0,
            };
            let opts = rotary_net::client::ReadOptions {
                block: false,
                metadata_only: true,
                do_not_proxy: false,
            };
            let mut s = client.read_with(&req, opts).await.ok()?;
            while let Some(e) = s.next().await {
                if let Ok(rotary_net::client::ReadEvent::Done(d)) = e {
                    // A read "at the head" is answered OFFSET_NOT_YET_AVAILABLE,
                    // with the head.
                    let known = matches!(
                        d.status,
                        rotary_net::Status::OK | rotary_net::Status::OFFSET_NOT_YET_AVAILABLE
                    );
                    return known.then_some((name, d.write_head));
                }
            }
            None
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Ok(Some(j)) = r {
            g.journals.push(j);
        }
    }
    g.journals.sort();
    g
}

/// OpenMetrics text as the classic Prometheus text format (0.0.4), for
/// scrapers that do not ask for OpenMetrics (`promtool`, older servers,
/// `curl`): a counter's HELP and TYPE name its samples' `_total` name, and
/// there is no `# EOF`. Samples are the same in both formats.
pub fn to_classic_text(open_metrics: &str) -> String {
    let mut out = String::with_capacity(open_metrics.len());
    let mut help: Option<&str> = None;
    for line in open_metrics.lines() {
        if line == "# EOF" {
            continue;
        }
        if line.starts_with("# HELP ") {
            if let Some(h) = help.replace(line) {
                out.push_str(h);
                out.push('\n');
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                if let Some(h) = help.take() {
                    let text = h
                        .strip_prefix("# HELP ")
                        .and_then(|t| t.strip_prefix(name))
                        .unwrap_or("");
                    out.push_str(&format!("# HELP {name}_total{text}\n"));
                }
                out.push_str(&format!("# TYPE {name}_total counter\n"));
                continue;
            }
        }
        if let Some(h) = help.take() {
            out.push_str(h);
            out.push('\n');
        }
        out.push_str(line);
        out.push('\n');
    }
    if let Some(h) = help {
        out.push_str(h);
        out.push('\n');
    }
    out
}

/// Whether a scraper's Accept header asks for OpenMetrics.
fn wants_open_metrics(accept: Option<&hyper::header::HeaderValue>) -> bool {
    accept
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// Answers `GET /metrics`, in OpenMetrics when the scraper asks for it
/// (Prometheus does), else in the classic text format.
pub(crate) async fn scrape(
    state: &Arc<State>,
    accept: Option<&hyper::header::HeaderValue>,
) -> Response<Body> {
    let gathered = gather(state).await;
    let mut registry = Registry::default();
    registry.register(
        "rotary_http_requests",
        "HTTP requests answered, by method and status code",
        state.http.requests.clone(),
    );
    registry.register(
        "rotary_http_put_seconds",
        "Latency of gateway PUTs that appended, from the request to the broker's acknowledgement",
        state.http.put_seconds.clone(),
    );
    registry.register(
        "rotary_http_read_bytes",
        "Journal bytes streamed to gateway GETs",
        state.http.read_bytes.clone(),
    );
    registry.register_collector(Box::new(BrokerCollector {
        state: state.clone(),
        gathered,
    }));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("INTERNAL: encoding metrics: {e}"),
        );
    }
    let (body, content_type) = if wants_open_metrics(accept) {
        (
            out,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    } else {
        (
            to_classic_text(&out),
            "text/plain; version=0.0.4; charset=utf-8",
        )
    };
    let mut r = Response::new(Body::full(body.into()));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        content_type.parse().expect("header"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counters_by_their_samples() {
        let om = "# HELP a_events Events seen.\n# TYPE a_events counter\na_events_total{shard=\"0\"} 3\n\
                  # HELP b_level Level.\n# TYPE b_level gauge\nb_level 2\n# EOF\n";
        assert_eq!(
            to_classic_text(om),
            "# HELP a_events_total Events seen.\n# TYPE a_events_total counter\na_events_total{shard=\"0\"} 3\n\
             # HELP b_level Level.\n# TYPE b_level gauge\nb_level 2\n"
        );
    }

    #[test]
    fn open_metrics_only_when_asked() {
        let v = |s: &str| hyper::header::HeaderValue::from_str(s).unwrap();
        assert!(wants_open_metrics(Some(&v(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        ))));
        assert!(!wants_open_metrics(Some(&v("*/*"))));
        assert!(!wants_open_metrics(None));
    }
}
