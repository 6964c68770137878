//! Parquet inputs: one document per row, in a named string column. Read through the
//! low-level column reader a batch of rows at a time, so only a page or so of the file is in
//! memory whatever its size.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::document::{Document, Sink};

const ROWS_PER_READ: usize = 1024;

pub fn read(path: &Path, column: &str, sink: &mut Sink) -> Result<()> {
    let name = path.display();
    let file = File::open(path).with_context(|| format!("{name}: cannot open"))?;
    let bytes = file.metadata()?.len();
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("{name}: cannot read as a Parquet file"))?;
    let meta = reader.metadata();
    let schema = meta.file_metadata().schema_descr();
    let index = (0..schema.num_columns())
        .find(|&i| schema.column(i).path().parts() == [column])
        .ok_or_else(|| {
            let columns: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
            anyhow!(
                "{name}: no column {column:?} (the file has {columns:?}); choose the text column with --text-column"
            )
        })?;
    let desc = schema.column(index);
    if desc.physical_type() != PhysicalType::BYTE_ARRAY || desc.max_rep_level() > 0 {
        bail!(
            "{name}: column {column:?} holds {:?} values, not one string per row; choose the text column with --text-column",
            desc.physical_type()
        );
    }
    let total_rows = meta.file_metadata().num_rows().max(1) as u64;
    let (mut row, mut values, mut levels) = (0u64, Vec::new(), Vec::new());
    for group in 0..reader.num_row_groups() {
        let at = |row: u64| format!("{name}: row {row}");
        let ColumnReader::ByteArrayColumnReader(mut col) = reader
            .get_row_group(group)
            .and_then(|g| g.get_column_reader(index))
            .with_context(|| at(row))?
        else {
            unreachable!("a BYTE_ARRAY column has a byte-array reader")
        };
        loop {
            values.clear();
            levels.clear();
            let (rows, _, _) = col
                .read_records(ROWS_PER_READ, Some(&mut levels), None, &mut values)
                .with_context(|| at(row))?;
            if rows == 0 {
                break;
            }
            // An optional column has one definition level per row, below the maximum for a
            // null; a required one has no levels.
            if let Some(k) = levels.iter().position(|&l| l < desc.max_def_level()) {
                bail!("{}: column {column:?} is null", at(row + k as u64));
            }
            for value in values.drain(..) {
                let text = value
                    .as_utf8()
                    .map_err(|_| anyhow!("{}: column {column:?} is not UTF-8 text", at(row)))?;
                row += 1;
                let offset = (bytes as u128 * row as u128 / total_rows as u128) as u64;
                sink(Document::text(text.to_owned()), offset)?;
            }
        }
    }
    Ok(())
}
