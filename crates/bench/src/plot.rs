//! The report as a picture (SVG): drain throughput per system and concurrency, and
//! schedule-to-start percentiles per system and load.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::Report;

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Writes `out` (SVG).
pub fn write(report: &Report, out: &Path) -> Result<()> {
    let root = SVGBackend::new(out, (1100, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(560);
    drains(report, &left).map_err(|e| anyhow!("drain panel: {e}"))?;
    latencies(report, &right).map_err(|e| anyhow!("latency panel: {e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// A percentile's name, how to read it, and its colour.
type Mark = (&'static str, fn(&super::Latency) -> f64, RGBColor);

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

fn drains(report: &Report, area: &Area) -> Result<(), Box<dyn std::error::Error>> {
    let systems = report.systems();
    let cs = report.concurrencies();
    let groups = cs.len().max(1);
    let width = systems.len().max(1) + 1;
    let top = cs
        .iter()
        .flat_map(|c| systems.iter().filter_map(|s| report.drain_median(s, *c)))
        .map(|d| d.steps_per_second)
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "drain throughput (steps/s, median of rounds)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..(groups * width) as f64, 0.0..top * 1.15)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("steps per second")
        .draw()?;
    for (g, c) in cs.iter().enumerate() {
        let x0 = (g * width) as f64;
        chart.draw_series(std::iter::once(Text::new(
            format!("concurrency {c}"),
            (x0 + 0.3, top * 1.1),
            ("sans-serif", 13),
        )))?;
        for (i, system) in systems.iter().enumerate() {
            let Some(d) = report.drain_median(system, *c) else {
                continue;
            };
            let x = x0 + i as f64 + 0.5;
            let color = COLORS[i % COLORS.len()];
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x, 0.0), (x + 0.9, d.steps_per_second)],
                color.filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{:.0}", d.steps_per_second),
                (x + 0.05, d.steps_per_second + top * 0.02),
                ("sans-serif", 12),
            )))?;
        }
    }
    for (i, system) in systems.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (0.0, 0.0)],
                color.filled(),
            )))?
            .label(system.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    Ok(())
}

fn latencies(report: &Report, area: &Area) -> Result<(), Box<dyn std::error::Error>> {
    let rows = &report.latencies;
    if rows.is_empty() {
        return Ok(());
    }
    let top = rows.iter().map(|l| l.p999_ms).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption("schedule-to-start, open loop (ms, log)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..rows.len() as f64, (0.1..top * 2.0).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("milliseconds")
        .draw()?;
    let marks: [Mark; 3] = [
        ("p50", |l| l.p50_ms, COLORS[0]),
        ("p99", |l| l.p99_ms, COLORS[1]),
        ("p99.9", |l| l.p999_ms, COLORS[2]),
    ];
    for (name, value, color) in marks {
        chart
            .draw_series(
                rows.iter().enumerate().map(|(i, l)| {
                    Circle::new((i as f64 + 0.5, value(l).max(0.1)), 5, color.filled())
                }),
            )?
            .label(name)
            .legend(move |(x, y)| Circle::new((x + 5, y), 5, color.filled()));
    }
    for (i, l) in rows.iter().enumerate() {
        chart.draw_series(std::iter::once(Text::new(
            format!("{} {}", l.system, l.load_label()),
            (i as f64 + 0.1, 0.12),
            ("sans-serif", 11),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    Ok(())
}
