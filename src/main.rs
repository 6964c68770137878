use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    match smelt::cli::Cli::parse().run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
