//! Aligned columns for people: each column as wide as its widest cell.

/// Rows under a header, printed with every column padded to its widest cell
/// (the last column is not padded).
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&'static str]) -> Self {
        Table { headers: headers.to_vec(), rows: Vec::new() }
    }

    /// Adds a row (missing cells are empty, extra ones dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text, one line per row, each ending in a newline.
    pub fn render(&self) -> String {
        self.render_with(true)
    }

    /// The rows only, aligned as if under the headers (for name/value lists).
    pub fn render_rows(&self) -> String {
        self.render_with(false)
    }

    fn render_with(&self, header: bool) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut text = String::new();
            for (i, cell) in cells.take(columns).enumerate() {
                if i + 1 < columns {
                    text.push_str(&format!("{cell:<width$}  ", width = widths[i]));
                } else {
                    text.push_str(cell);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        if header {
            line(&mut self.headers.iter().copied());
        }
        for row in &self.rows {
            let mut cells = row.iter().map(String::as_str).chain(std::iter::repeat(""));
            line(&mut cells);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Table;

    #[test]
    fn columns_line_up_under_their_headers() {
        let mut t = Table::new(&["ID", "STATE", "ERROR"]);
        t.row(vec!["a".into(), "failed".into(), "boom".into()]);
        t.row(vec!["bbbb".into(), "ok".into()]);
        assert_eq!(t.render(), "ID    STATE   ERROR\na     failed  boom\nbbbb  ok\n");
    }
}
