//! Markdown tables, number formatting, percentiles and RSS.

use std::time::Duration;

/// A Markdown table, printed when done.
///
/// ```
/// let mut t = durastep_benches::report::Table::new("Raw", &["what", "rows/s"]);
/// t.row(vec!["insert".into(), "11,000".into()]);
/// assert!(t.render().contains("| insert | 11,000 |"));
/// ```
pub struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with a title and column headers.
    pub fn new(title: &str, headers: &[&str]) -> Table {
        Table { title: title.to_owned(), headers: headers.iter().map(|h| (*h).to_owned()).collect(), rows: vec![] }
    }

    /// Adds a row (as many cells as headers).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as Markdown, title first.
    pub fn render(&self) -> String {
        let mut out = format!(
            "\n### {}\n\n| {} |\n|{}\n",
            self.title,
            self.headers.join(" | "),
            "---|".repeat(self.headers.len())
        );
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }

    /// Prints the table to stdout.
    pub fn print(&self) {
        println!("{}", self.render());
    }
}

/// A count with thousands separators.
///
/// ```
/// assert_eq!(durastep_benches::report::thousands(12345.6), "12,346");
/// assert_eq!(durastep_benches::report::thousands(999.0), "999");
/// ```
pub fn thousands(x: f64) -> String {
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Milliseconds with two decimals.
///
/// ```
/// assert_eq!(durastep_benches::report::ms(std::time::Duration::from_micros(1234)), "1.23 ms");
/// ```
pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// A ratio, `a / b`, as `0.83x`.
///
/// ```
/// assert_eq!(durastep_benches::report::ratio(5.0, 10.0), "0.50x");
/// ```
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 { format!("{:.2}x", a / b) } else { "n/a".to_owned() }
}

/// The `p`-th percentile (0..=100, nearest rank) of some durations.
///
/// ```
/// use std::time::Duration;
/// let xs: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
/// assert_eq!(durastep_benches::report::percentile(&xs, 50.0), Duration::from_millis(50));
/// assert_eq!(durastep_benches::report::percentile(&xs, 99.0), Duration::from_millis(99));
/// ```
pub fn percentile(xs: &[Duration], p: f64) -> Duration {
    if xs.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = xs.to_vec();
    sorted.sort();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// The median of some values: the middle one, or the mean of the two
/// middle ones when there is an even number (two rounds give their mean,
/// not the larger). NaN for none.
///
/// ```
/// use durastep_benches::report::median;
/// assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
/// assert_eq!(median([10.0, 4.0]), 7.0);
/// ```
pub fn median(xs: impl IntoIterator<Item = f64>) -> f64 {
    let mut xs: Vec<f64> = xs.into_iter().collect();
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 0 => (xs[mid - 1] + xs[mid]) / 2.0,
        _ => xs[mid],
    }
}

/// Resident set size of a process in KiB, from `/proc/<pid>/status` (`VmRSS`).
///
/// ```
/// # #[cfg(target_os = "linux")]
/// assert!(durastep_benches::report::rss_kib(std::process::id()).unwrap() > 0);
/// ```
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// CPU time the whole machine has spent busy since boot (user, nice, system,
/// interrupts; not idle, I/O wait or steal), from the first line of
/// `/proc/stat` in clock ticks of 1/100 s (Linux's `USER_HZ` on every common
/// platform). The difference over a drain, divided by its runs, is the CPU a
/// run costs (engine, worker and Postgres together): it moves less than runs
/// per second when the machine's host is busy elsewhere, but it still moves
/// (up to about 30% between drains here), so compare medians.
/// `None` off Linux.
///
/// ```
/// # #[cfg(target_os = "linux")]
/// assert!(durastep_benches::report::machine_busy_cpu().unwrap() > std::time::Duration::ZERO);
/// ```
pub fn machine_busy_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> =
        stat.lines().next()?.split_whitespace().skip(1).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let busy = [0, 1, 2, 5, 6].iter().filter_map(|&i| fields.get(i)).sum::<u64>();
    Some(Duration::from_millis(busy * 10))
}

/// The CPU time process `pid` has used so far (user and system, from
/// `/proc/<pid>/stat`; None where that cannot be read).
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces, in parentheses).
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Whether a figure meets its target, as a table cell.
///
/// ```
/// assert_eq!(durastep_benches::report::verdict(true), "met");
/// ```
pub fn verdict(met: bool) -> String {
    if met { "met".to_owned() } else { "**missed**".to_owned() }
}

/// The machine-readable line of one figure: `RESULT metric=<name> value=<v>
/// ratio=<r>` (`ratio=` left out for a figure that has none), for scripts
/// that compare runs. Printed to stdout beside the tables.
///
/// ```
/// use durastep_benches::report::result_line;
/// assert_eq!(result_line("drain_runs_per_s", 9000.0, Some(0.25)), "RESULT metric=drain_runs_per_s value=9000.000 ratio=0.250");
/// assert_eq!(result_line("send_round_trips", 1.0, None), "RESULT metric=send_round_trips value=1.000");
/// ```
pub fn result_line(metric: &str, value: f64, ratio: Option<f64>) -> String {
    match ratio {
        Some(r) => format!("RESULT metric={metric} value={value:.3} ratio={r:.3}"),
        None => format!("RESULT metric={metric} value={value:.3}"),
    }
}

/// Prints [`result_line`].
pub fn result(metric: &str, value: f64, ratio: Option<f64>) {
    println!("{}", result_line(metric, value, ratio));
}
