//! `rotary doctor`: host checks, implemented by `rotary-tuning`.

use std::path::Path;

/// Runs the host checks for a data directory; returns the exit code.
pub fn run(data_dir: &Path) -> i32 {
    // TEMPORARY STUB: `rotary_tuning::doctor::run` does not exist yet. Replace
    // this body with `rotary_tuning::doctor::run(data_dir)` once it lands.
    eprintln!(
        "error: NOT_IMPLEMENTED: host checks for {} are not available in this build",
        data_dir.display()
    );
    1
}
