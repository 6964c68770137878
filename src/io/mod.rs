//! Reading and writing HF model directories.
