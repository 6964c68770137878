//! Training data: token files.

pub mod tokfile;
