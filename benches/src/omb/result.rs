//! The result of one workload run, written as OMB's result JSON: its field
//! names, its units (latencies in ms, publish delay in µs), one series value
//! per period, whole-run aggregates and quantile maps. Fields OMB does not
//! have (durability, delivery check, backlog drain) are added beside them;
//! OMB's own tools ignore fields they do not know.

use super::stats::Histos;
use hdrhistogram::Histogram;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{json, Value};

/// A JSON object that keeps its fields in insertion order (serde_json's
/// own map sorts them, which would put `"10.0"` before `"2.0"` in the
/// quantile maps and scatter OMB's field order).
#[derive(Clone, Debug, Default)]
pub struct Map(Vec<(String, Value)>);

impl Map {
    pub fn new() -> Map {
        Map::default()
    }

    pub fn insert(&mut self, key: String, value: Value) {
        self.0.push((key, value));
    }

    #[cfg(test)]
    fn into_value(self) -> Value {
        Value::Object(self.0.into_iter().collect())
    }
}

/// A value whose objects keep their order when serialized: objects nested
/// in a [`Map`] are kept as [`Map`]s here.
pub enum Ordered {
    Value(Value),
    Map(Vec<(String, Ordered)>),
}

impl Serialize for Ordered {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Ordered::Value(v) => v.serialize(s),
            Ordered::Map(fields) => {
                let mut m = s.serialize_map(Some(fields.len()))?;
                for (k, v) in fields {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

/// Suffixes of every latency summary, in OMB's order.
pub const SUMMARY_SUFFIXES: [&str; 8] = [
    "Avg", "50pct", "75pct", "95pct", "99pct", "999pct", "9999pct", "Max",
];
/// Quantiles of the summaries, matching [`SUMMARY_SUFFIXES`] 1..=6.
const SUMMARY_QUANTILES: [f64; 6] = [0.50, 0.75, 0.95, 0.99, 0.999, 0.9999];
/// Name prefixes of the three latencies, in series and aggregates.
pub const PUBLISH_LATENCY: &str = "publishLatency";
pub const PUBLISH_DELAY: &str = "publishDelayLatency";
pub const END_TO_END: &str = "endToEndLatency";

/// Percentiles of the quantile maps: 1 to 99 in steps of 1, then the nines.
pub fn quantile_points() -> Vec<f64> {
    let mut points: Vec<f64> = (1..=99).map(f64::from).collect();
    points.extend([99.9, 99.99, 99.999, 100.0]);
    points
}

/// How a latency histogram (µs) is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Milliseconds as a fraction.
    Ms,
    /// Whole microseconds.
    Us,
}

impl Unit {
    fn of(self, us: f64) -> Value {
        match self {
            Unit::Ms => json!(us / 1000.0),
            Unit::Us => json!(us.round() as u64),
        }
    }
}

/// Avg, p50 … p99.99, max of a histogram in `unit` (avg always a fraction).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Values in µs, in [`SUMMARY_SUFFIXES`] order.
    pub us: [f64; 8],
}

impl Summary {
    pub fn of(h: &Histogram<u64>) -> Summary {
        let mut us = [0.0; 8];
        if h.is_empty() {
            return Summary { us };
        }
        us[0] = h.mean();
        for (i, q) in SUMMARY_QUANTILES.iter().enumerate() {
            us[i + 1] = h.value_at_quantile(*q) as f64;
        }
        us[7] = h.max() as f64;
        Summary { us }
    }

    /// Milliseconds of [`SUMMARY_SUFFIXES`]`[i]`.
    pub fn ms(&self, i: usize) -> f64 {
        self.us[i] / 1000.0
    }
}

/// `(percentile, value in µs)` at [`quantile_points`].
pub fn quantiles(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    quantile_points()
        .into_iter()
        .map(|p| {
            let v = if h.is_empty() {
                0.0
            } else {
                h.value_at_quantile(p / 100.0) as f64
            };
            (p, v)
        })
        .collect()
}

/// One period of the run.
#[derive(Clone, Debug, Default)]
pub struct Period {
    pub publish_rate: f64,
    pub publish_error_rate: f64,
    pub consume_rate: f64,
    pub backlog: i64,
    pub publish_latency: Summary,
    pub publish_delay: Summary,
    pub end_to_end: Summary,
}

/// A whole run.
pub struct TestResult {
    pub workload: String,
    pub driver: String,
    pub message_size: usize,
    pub topics: usize,
    pub partitions: usize,
    pub producers_per_topic: usize,
    pub consumers_per_topic: usize,
    pub period_ms: u64,
    pub periods: Vec<Period>,
    /// Measured phase only (warm-up discarded).
    pub aggregate: Histos,
    /// Fields OMB does not have, written after its own.
    pub extra: Map,
    /// Why the run failed, if it did; the result is still written.
    pub problems: Vec<String>,
}

fn summary_fields(out: &mut Map, prefix: &str, s: &Summary, unit: Unit) {
    for (i, suffix) in SUMMARY_SUFFIXES.iter().enumerate() {
        let v = if i == 0 {
            // OMB's averages are doubles in every unit.
            match unit {
                Unit::Ms => json!(s.us[0] / 1000.0),
                Unit::Us => json!(s.us[0]),
            }
        } else {
            unit.of(s.us[i])
        };
        out.insert(format!("{prefix}{suffix}"), v);
    }
}

fn series_fields(out: &mut Map, prefix: &str, ss: &[&Summary], unit: Unit) {
    for (i, suffix) in SUMMARY_SUFFIXES.iter().enumerate() {
        let values: Vec<Value> = ss
            .iter()
            .map(|s| match (i, unit) {
                (0, Unit::Us) => json!(s.us[0]),
                _ => unit.of(s.us[i]),
            })
            .collect();
        out.insert(format!("{prefix}{suffix}"), Value::Array(values));
    }
}

/// A quantile map keyed as OMB's (Java's `Double.toString`: `1.0`, `99.9`).
fn quantile_map(h: &Histogram<u64>, unit: Unit) -> Ordered {
    Ordered::Map(
        quantiles(h)
            .into_iter()
            .map(|(p, us)| (percentile_key(p), Ordered::Value(unit.of(us))))
            .collect(),
    )
}

pub fn percentile_key(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{p:.1}")
    } else {
        format!("{p}")
    }
}

impl TestResult {
    /// OMB's result JSON as a value (fields in no particular order).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self.to_ordered()).expect("result serializes")
    }

    /// OMB's result JSON as text, fields in OMB's order, extras after.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(&self.to_ordered()).expect("result serializes")
    }

    fn to_ordered(&self) -> Ordered {
        let mut m = Map::new();
        let mut quantile_maps = Vec::new();
        m.insert("workload".into(), json!(self.workload));
        m.insert("driver".into(), json!(self.driver));
        m.insert("messageSize".into(), json!(self.message_size));
        m.insert("topics".into(), json!(self.topics));
        m.insert("partitions".into(), json!(self.partitions));
        m.insert("producersPerTopic".into(), json!(self.producers_per_topic));
        m.insert("consumersPerTopic".into(), json!(self.consumers_per_topic));
        m.insert("sampleRateMillis".into(), json!(self.period_ms));
        let col = |f: fn(&Period) -> Value| -> Value {
            Value::Array(self.periods.iter().map(f).collect())
        };
        m.insert("publishRate".into(), col(|p| json!(p.publish_rate)));
        m.insert(
            "publishErrorRate".into(),
            col(|p| json!(p.publish_error_rate)),
        );
        m.insert("consumeRate".into(), col(|p| json!(p.consume_rate)));
        m.insert("backlog".into(), col(|p| json!(p.backlog)));
        let pl: Vec<&Summary> = self.periods.iter().map(|p| &p.publish_latency).collect();
        let pd: Vec<&Summary> = self.periods.iter().map(|p| &p.publish_delay).collect();
        let e2e: Vec<&Summary> = self.periods.iter().map(|p| &p.end_to_end).collect();
        series_fields(&mut m, PUBLISH_LATENCY, &pl, Unit::Ms);
        series_fields(&mut m, PUBLISH_DELAY, &pd, Unit::Us);
        let a = &self.aggregate;
        summary_fields(
            &mut m,
            "aggregatedPublishLatency",
            &Summary::of(&a.publish_latency_us),
            Unit::Ms,
        );
        summary_fields(
            &mut m,
            "aggregatedPublishDelayLatency",
            &Summary::of(&a.publish_delay_us),
            Unit::Us,
        );
        quantile_maps.push((
            m.0.len(),
            "aggregatedPublishLatencyQuantiles",
            quantile_map(&a.publish_latency_us, Unit::Ms),
        ));
        quantile_maps.push((
            m.0.len(),
            "aggregatedPublishDelayLatencyQuantiles",
            quantile_map(&a.publish_delay_us, Unit::Us),
        ));
        series_fields(&mut m, END_TO_END, &e2e, Unit::Ms);
        summary_fields(
            &mut m,
            "aggregatedEndToEndLatency",
            &Summary::of(&a.end_to_end_us),
            Unit::Ms,
        );
        quantile_maps.push((
            m.0.len(),
            "aggregatedEndToEndLatencyQuantiles",
            quantile_map(&a.end_to_end_us, Unit::Ms),
        ));
        for (k, v) in &self.extra.0 {
            m.insert(k.clone(), v.clone());
        }
        m.insert("problems".into(), json!(self.problems));
        // The quantile maps go where OMB has them, as ordered maps.
        let mut fields: Vec<(String, Ordered)> = Vec::new();
        let mut maps = quantile_maps.into_iter().peekable();
        for (i, (k, v)) in m.0.into_iter().enumerate() {
            while let Some((_, name, map)) = maps.next_if(|(at, _, _)| *at == i) {
                fields.push((name.to_string(), map));
            }
            fields.push((k, Ordered::Value(v)));
        }
        for (_, name, map) in maps {
            fields.push((name.to_string(), map));
        }
        Ordered::Map(fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_like_javas_doubles() {
        assert_eq!(percentile_key(1.0), "1.0");
        assert_eq!(percentile_key(50.0), "50.0");
        assert_eq!(percentile_key(99.9), "99.9");
        assert_eq!(percentile_key(99.99), "99.99");
        assert_eq!(percentile_key(100.0), "100.0");
    }

    #[test]
    fn summaries_convert_units() {
        let mut h = super::super::stats::Histos::new();
        for us in [1_000u64, 2_000, 3_000, 4_000] {
            h.publish_latency_us.record(us).unwrap();
        }
        let s = Summary::of(&h.publish_latency_us);
        assert!((s.ms(0) - 2.5).abs() < 0.01);
        assert!((s.ms(7) - 4.0).abs() < 0.01);
        let mut m = Map::new();
        summary_fields(&mut m, "x", &s, Unit::Us);
        assert_eq!(m.into_value()["xMax"], json!(4000));
        let q = quantiles(&h.publish_latency_us);
        assert_eq!(q.len(), 103);
        assert!(q.windows(2).all(|w| w[0].1 <= w[1].1));
    }
}
