//! Aligned text tables that fit a terminal of a given width (80 columns
//! for `get`). When the columns do not fit, the widest text columns (ids,
//! names) are cut and end in `~`; numbers are never cut, so a table may
//! only exceed the width when its numbers alone do not fit.

/// Spaces between two columns.
const GAP: usize = 2;

/// A cut cell or header never gets narrower than this.
const MIN_CUT_WIDTH: usize = 6;

/// The width `get` and `top` draw for.
pub const TERMINAL_WIDTH: usize = 80;

/// One column: its header, and whether its cells may be cut to fit.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    /// Shown upper case, as `ID`, `STATE`.
    pub header: &'static str,
    /// True for free text (ids, names, labels); false for numbers and
    /// short words, which must be read whole.
    pub cut: bool,
}

impl Column {
    /// A column of free text that may be cut.
    pub const fn text(header: &'static str) -> Self {
        Self { header, cut: true }
    }

    /// A column that is always printed whole.
    pub const fn whole(header: &'static str) -> Self {
        Self { header, cut: false }
    }
}

/// A table being built, row by row.
#[derive(Debug)]
pub struct Table {
    columns: Vec<Column>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Starts a table with these columns.
    pub fn new(columns: &[Column]) -> Self {
        Self {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; it must have one cell per column.
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.columns.len());
        self.rows.push(cells);
    }

    /// Returns the table as lines of at most `width` characters (see the
    /// module doc for when that is impossible), without trailing spaces.
    pub fn render(&self, width: usize) -> Vec<String> {
        let widths = self.fit(width);
        let header: Vec<String> = self.columns.iter().map(|c| c.header.to_owned()).collect();
        std::iter::once(&header)
            .chain(&self.rows)
            .map(|cells| line(cells, &widths))
            .collect()
    }

    /// Returns each column's width: the widest cell, then the widest
    /// cuttable columns narrowed one character at a time until the table
    /// fits.
    fn fit(&self, width: usize) -> Vec<usize> {
        let mut widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                self.rows
                    .iter()
                    .map(|r| chars(&r[i]))
                    .chain([c.header.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let gaps = GAP * self.columns.len().saturating_sub(1);
        while widths.iter().sum::<usize>() + gaps > width {
            let widest = (0..widths.len())
                .filter(|&i| self.columns[i].cut)
                .filter(|&i| widths[i] > MIN_CUT_WIDTH.max(self.columns[i].header.len()))
                .max_by_key(|&i| (widths[i], i));
            match widest {
                Some(i) => widths[i] -= 1,
                None => break,
            }
        }
        widths
    }
}

/// One line: each cell cut or padded to its width, the last not padded.
fn line(cells: &[String], widths: &[usize]) -> String {
    let mut out = String::new();
    for (i, (cell, &width)) in cells.iter().zip(widths).enumerate() {
        if i > 0 {
            out.push_str(&" ".repeat(GAP));
        }
        let cell = cut(cell, width);
        let pad = width - chars(&cell);
        out.push_str(&cell);
        out.push_str(&" ".repeat(pad));
    }
    out.trim_end().to_owned()
}

/// Returns `text` if it fits `width` characters, else its start and `~`.
fn cut(text: &str, width: usize) -> String {
    if chars(text) <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('~');
    cut
}

fn chars(text: &str) -> usize {
    text.chars().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: &[[&str; 3]]) -> Table {
        let mut t = Table::new(&[
            Column::text("NAME"),
            Column::whole("STATE"),
            Column::text("LABELS"),
        ]);
        for r in rows {
            t.row(r.iter().map(|c| (*c).to_owned()).collect());
        }
        t
    }

    #[test]
    fn columns_are_aligned_and_lines_not_padded() {
        let lines = table(&[["a", "connected", "x=1"], ["long-name", "lost", ""]]).render(80);
        assert_eq!(
            lines,
            [
                "NAME       STATE      LABELS",
                "a          connected  x=1",
                "long-name  lost",
            ]
        );
    }

    #[test]
    fn the_widest_text_column_is_cut_to_fit() {
        let long = "l".repeat(70);
        let lines = table(&[["stage-with-a-long-id", "connected", &long]]).render(40);
        for line in &lines {
            assert!(line.chars().count() <= 40, "{line:?}");
        }
        // 27 characters for the two text columns: 14 and 13.
        assert_eq!(
            lines[1],
            format!("stage-with-a-~  connected  {}~", "l".repeat(12))
        );
    }

    #[test]
    fn whole_columns_are_never_cut() {
        let lines = table(&[["abcdefghijkl", "a-very-long-state-word", "x"]]).render(10);
        assert!(lines[1].contains("a-very-long-state-word"));
        assert!(lines[1].starts_with("abcde~"), "{lines:?}");
    }
}
