//! The console's small overview of the four metric levels (docs/design.md §7): each service's
//! `/metrics` scraped, summed by name across instances and labels, grouped by the level the
//! name keeps (`z29c_lease_*`, `z29c_attempt_*`, `z29c_step_*`, `z29c_workflow*`), and what
//! the database keeps (`z29c_storage_*`: every recovery instance reports the same tables, so
//! these take the largest report instead of the sum).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// The levels in the order a person reads them: outcomes first, worker churn last.
pub const LEVELS: [(&str, &str); 5] = [
    ("workflow", "Workflows: outcomes"),
    ("step", "Steps: what is known about external effects"),
    ("attempt", "Attempts: one try each"),
    ("lease", "Leases: who may work (churn, not results)"),
    ("storage", "Storage: what the database keeps"),
];

#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    pub levels: Vec<Level>,
    pub sources: Vec<Source>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Level {
    pub level: &'static str,
    pub title: &'static str,
    pub metrics: Vec<Metric>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Metric {
    pub name: String,
    pub value: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Source {
    pub url: String,
    pub error: Option<String>,
}

/// The level a metric name belongs to, if it is one of z29c's.
pub fn level_of(name: &str) -> Option<&'static str> {
    let rest = name.strip_prefix("z29c_")?;
    LEVELS.iter().map(|(l, _)| *l).find(|l| rest.starts_with(l))
}

/// The labels the overview keeps apart; every other label is summed over.
const KEPT_LABELS: [&str; 3] = ["state", "verification", "table"];

/// Sums the samples of `text` (Prometheus text format) into `into`, by metric name and the
/// [`KEPT_LABELS`]. Histogram buckets and sums are left out; their `_count` is kept.
pub fn add_samples(text: &str, into: &mut BTreeMap<String, f64>) -> anyhow::Result<()> {
    use prometheus_parse::Value;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))?;
    for s in scrape.samples {
        if level_of(&s.metric).is_none() || s.metric.ends_with("_sum") {
            continue;
        }
        let v = match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            Value::Histogram(_) | Value::Summary(_) => continue,
        };
        let largest = level_of(&s.metric) == Some("storage");
        let kept: Vec<String> = KEPT_LABELS
            .iter()
            .filter_map(|l| s.labels.get(l).map(|v| format!("{l}={v}")))
            .collect();
        let key = if kept.is_empty() {
            s.metric
        } else {
            format!("{}{{{}}}", s.metric, kept.join(","))
        };
        let entry = into.entry(key).or_default();
        if largest {
            *entry = entry.max(v);
        } else {
            *entry += v;
        }
    }
    Ok(())
}

/// Scrapes every URL (2 s each) and groups what they say by level.
pub async fn overview(http: &reqwest::Client, urls: &[String]) -> Overview {
    let mut sums = BTreeMap::new();
    let mut sources = Vec::with_capacity(urls.len());
    for url in urls {
        let text = async {
            let r = http
                .get(url)
                .timeout(Duration::from_secs(2))
                .send()
                .await?
                .error_for_status()?;
            anyhow::Ok(r.text().await?)
        }
        .await;
        let error = match text.and_then(|t| add_samples(&t, &mut sums)) {
            Ok(()) => None,
            Err(e) => Some(format!("{e:#}")),
        };
        sources.push(Source {
            url: url.clone(),
            error,
        });
    }
    let levels = LEVELS
        .iter()
        .map(|(level, title)| Level {
            level,
            title,
            metrics: sums
                .iter()
                .filter(|(n, _)| level_of(n) == Some(*level))
                .map(|(n, v)| Metric {
                    name: n.clone(),
                    value: *v,
                })
                .collect(),
        })
        .collect();
    Overview { levels, sources }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_sum_by_name_and_keep_their_level() {
        let a = "# TYPE z29c_lease_acquisitions_total counter\n\
                 z29c_lease_acquisitions_total 3\n\
                 # TYPE z29c_step_receipts_total counter\n\
                 z29c_step_receipts_total{verification=\"direct\",outcome=\"succeeded\"} 2\n\
                 z29c_step_receipts_total{verification=\"manual\",outcome=\"succeeded\"} 1\n\
                 # TYPE z29c_lease_expiry_age_seconds histogram\n\
                 z29c_lease_expiry_age_seconds_bucket{le=\"1\"} 1\n\
                 z29c_lease_expiry_age_seconds_bucket{le=\"+Inf\"} 2\n\
                 z29c_lease_expiry_age_seconds_sum 1.5\n\
                 z29c_lease_expiry_age_seconds_count 2\n\
                 process_cpu_seconds_total 9\n";
        let b = "z29c_lease_acquisitions_total 4\nz29c_workflows{state=\"completed\"} 5\n";
        let mut sums = BTreeMap::new();
        add_samples(a, &mut sums).unwrap();
        add_samples(b, &mut sums).unwrap();
        assert_eq!(sums["z29c_lease_acquisitions_total"], 7.0);
        assert_eq!(sums["z29c_step_receipts_total{verification=direct}"], 2.0);
        assert_eq!(sums["z29c_step_receipts_total{verification=manual}"], 1.0);
        assert_eq!(sums["z29c_lease_expiry_age_seconds_count"], 2.0);
        assert_eq!(sums["z29c_workflows{state=completed}"], 5.0);
        assert!(!sums.contains_key("z29c_lease_expiry_age_seconds_sum"));
        assert!(!sums.contains_key("process_cpu_seconds_total"));
        assert_eq!(level_of("z29c_workflows"), Some("workflow"));
        assert_eq!(
            level_of("z29c_attempt_late_observations_total"),
            Some("attempt")
        );
        assert_eq!(level_of("http_requests_total"), None);
    }

    #[test]
    fn storage_takes_the_largest_report_per_table_not_the_sum() {
        let one = "z29c_storage_table_bytes{table=\"steps\"} 8192
                   z29c_storage_table_bytes{table=\"workflows\"} 100
                   z29c_storage_oldest_workflow_age_seconds 60
";
        let other = "z29c_storage_table_bytes{table=\"steps\"} 16384
                     z29c_storage_oldest_workflow_age_seconds 61
";
        let mut sums = BTreeMap::new();
        add_samples(one, &mut sums).unwrap();
        add_samples(other, &mut sums).unwrap();
        assert_eq!(sums["z29c_storage_table_bytes{table=steps}"], 16384.0);
        assert_eq!(sums["z29c_storage_table_bytes{table=workflows}"], 100.0);
        assert_eq!(sums["z29c_storage_oldest_workflow_age_seconds"], 61.0);
        assert_eq!(level_of("z29c_storage_table_bytes"), Some("storage"));
    }
}
