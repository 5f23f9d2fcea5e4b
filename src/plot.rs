//! Plots of the whole-job benchmarks: each bench writes its figures as JSON and, next to
//! them, a grouped bar chart as SVG (plotters' SVG backend: text stays text, so no font
//! library is needed).

use plotters::prelude::*;
use std::path::Path;

/// One series of a grouped bar chart: its name and one value per group (`None`: not
/// measured, no bar).
pub type Series = (String, Vec<Option<f64>>);

/// A grouped bar chart.
pub struct Bars<'a> {
    /// Title, above the chart.
    pub title: &'a str,
    /// What the y axis measures, with its unit.
    pub y: &'a str,
    /// The groups along the x axis, in order.
    pub groups: Vec<String>,
    /// The bars of each group, one per series, in order.
    pub series: Vec<Series>,
    /// A logarithmic y axis (for figures that span orders of magnitude).
    pub log: bool,
}

/// Distinct colours for up to 16 series (then they repeat).
const PALETTE: [RGBColor; 16] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(255, 152, 150),
    RGBColor(197, 176, 213),
    RGBColor(0, 0, 0),
];

/// Writes `bars` as an SVG beside a bench's JSON results (`bench-x.json` →
/// `bench-x.svg`) and says where, or why not.
pub fn write_beside(json: &Path, bars: &Bars<'_>) {
    let svg = json.with_extension("svg");
    match bars.write_svg(&svg) {
        Ok(()) => println!("plot: {}", svg.display()),
        Err(e) => eprintln!("no plot: {e}"),
    }
}

impl Bars<'_> {
    /// Writes the chart to `path` as SVG.
    ///
    /// # Errors
    /// No value to plot, or the file cannot be written.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        let values = || self.series.iter().flat_map(|(_, v)| v.iter().flatten().copied());
        let top = values().fold(f64::NAN, f64::max);
        if !top.is_finite() || top <= 0.0 {
            return Err(format!("{}: nothing to plot", self.title));
        }
        const LEGEND: u32 = 240;
        let n = self.groups.len();
        let bars = (n * self.series.len()) as u32;
        let width = (120 + 18 * bars + 24 * n as u32).max(480) + LEGEND;
        let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
        root.fill(&WHITE).map_err(e)?;
        let (plot, legend) = root.split_horizontally(width - LEGEND);
        let mut chart = ChartBuilder::on(&plot);
        chart.caption(self.title, ("sans-serif", 18)).margin(12).x_label_area_size(36).y_label_area_size(64);
        let x = -0.5..n as f64 - 0.5;
        let label = |v: &f64| {
            let i = v.round();
            if (v - i).abs() < 1e-9 && i >= 0.0 {
                self.groups.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        if self.log {
            let low = values().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min) / 2.0;
            let mut c = chart.build_cartesian_2d(x, (low..top * 2.0).log_scale()).map_err(e)?;
            c.configure_mesh().x_labels(n).x_label_formatter(&label).y_desc(self.y).draw().map_err(e)?;
            self.draw(&mut c, low).map_err(e)?;
        } else {
            let mut c = chart.build_cartesian_2d(x, 0.0..top * 1.1).map_err(e)?;
            c.configure_mesh().x_labels(n).x_label_formatter(&label).y_desc(self.y).draw().map_err(e)?;
            self.draw(&mut c, 0.0).map_err(e)?;
        }
        // The legend beside the chart, where it hides no bar.
        for (j, (name, _)) in self.series.iter().enumerate() {
            let y = 48 + 20 * j as i32;
            let color = PALETTE[j % PALETTE.len()];
            legend.draw(&Rectangle::new([(8, y - 6), (20, y + 6)], color.filled())).map_err(e)?;
            legend.draw(&Text::new(name.as_str(), (28, y - 7), ("sans-serif", 13))).map_err(e)?;
        }
        root.present().map_err(e)
    }

    /// Draws every series' bars, side by side within each group, from `base` up.
    fn draw<'b, DB: DrawingBackend + 'b, Y: Ranged<ValueType = f64>>(
        &self,
        chart: &mut ChartContext<'b, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>,
        base: f64,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let k = self.series.len().max(1) as f64;
        let w = 0.8 / k;
        for (j, (_, values)) in self.series.iter().enumerate() {
            let color = PALETTE[j % PALETTE.len()];
            let left = |i: usize| i as f64 - 0.4 + w * j as f64;
            let bars = values.iter().enumerate().filter_map(|(i, v)| v.map(|v| (i, v)));
            chart.draw_series(
                bars.map(|(i, v)| Rectangle::new([(left(i), base), (left(i) + w * 0.9, v)], color.filled())),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_a_bar_per_value_and_names_its_groups_and_series() {
        let dir = std::env::temp_dir().join(format!("ductile-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for log in [false, true] {
            let bars = Bars {
                title: "redistribution",
                y: "GB/s",
                groups: vec!["2→4".into(), "4→2".into()],
                series: vec![
                    ("tcp rma".into(), vec![Some(3.5), None]),
                    ("Open MPI".into(), vec![Some(2.0), Some(1.5)]),
                ],
                log,
            };
            let path = dir.join(format!("bars-{log}.svg"));
            bars.write_svg(&path).unwrap();
            let svg = std::fs::read_to_string(&path).unwrap();
            for text in ["redistribution", "GB/s", "2→4", "4→2", "tcp rma", "Open MPI"] {
                assert!(svg.contains(text), "{text} missing (log {log})");
            }
            // Three bars and two legend swatches, each a filled rectangle of its series.
            assert_eq!(svg.matches("fill=\"#1F77B4\"").count(), 2, "log {log}");
            assert_eq!(svg.matches("fill=\"#FF7F0E\"").count(), 3, "log {log}");
        }
        let empty =
            Bars { title: "t", y: "y", groups: vec!["a".into()], series: vec![("s".into(), vec![None])], log: false };
        assert!(empty.write_svg(&dir.join("empty.svg")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
