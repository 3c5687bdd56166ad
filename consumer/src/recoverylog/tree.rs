//! The directory a player rebuilds files in: effects applied to real
//! files with `std::fs`, under one root and never outside it.
//!
//! Paths are [`LogPath`]s, which cannot be absolute or hold `.` or `..`
//! components, and the root starts empty, so every path this module
//! touches is one it made under the root. Directories are not recorded:
//! parents are created as files need them and left in place.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};

use super::error::Error;
use super::fsm::Effect;
use super::ops::LogPath;

#[derive(Debug)]
pub(crate) struct Tree {
    root: PathBuf,
}

impl Tree {
    /// The tree at `root`, which must be missing (it is created) or empty.
    pub fn create(root: &Path) -> Result<Tree, Error> {
        let io_error = |source| Error::Io {
            path: root.to_owned(),
            source,
        };
        match fs::read_dir(root) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(Error::RootNotEmpty(root.to_owned()));
                }
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(root).map_err(io_error)?
            }
            Err(error) => return Err(io_error(error)),
        }
        Ok(Tree {
            root: root.to_owned(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where `path` lies under the root.
    fn path(&self, path: &LogPath) -> PathBuf {
        let relative = Path::new(path.as_str());
        assert!(
            relative
                .components()
                .all(|c| matches!(c, Component::Normal(_))),
            "a LogPath stays under the root: {path}"
        );
        self.root.join(relative)
    }

    pub fn apply(&self, effect: &Effect) -> Result<(), Error> {
        let (path, result) = match effect {
            Effect::Create { path } => {
                let path = self.path(path);
                let result = parent(&path).and_then(|()| {
                    OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&path)
                        .map(drop)
                });
                (path, result)
            }
            Effect::Link { from, to } => {
                let (from, to) = (self.path(from), self.path(to));
                let result = parent(&to).and_then(|()| fs::hard_link(&from, &to));
                (to, result)
            }
            Effect::Unlink { path } => {
                let path = self.path(path);
                let result = fs::remove_file(&path);
                (path, result)
            }
            Effect::Write { path, offset, data } => {
                let path = self.path(path);
                let result = open(&path).and_then(|file| file.write_all_at(data, *offset));
                (path, result)
            }
            Effect::Truncate { path, length } => {
                let path = self.path(path);
                let result = open(&path).and_then(|file| file.set_len(*length));
                (path, result)
            }
        };
        result.map_err(|source| Error::Io { path, source })
    }
}

fn open(path: &Path) -> io::Result<fs::File> {
    OpenOptions::new().write(true).open(path)
}

fn parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(parent) => fs::create_dir_all(parent),
        None => Ok(()),
    }
}
