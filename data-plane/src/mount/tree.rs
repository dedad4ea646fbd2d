//! A data set's listing as a directory tree: which names each directory
//! holds, built once per listing (a listing changes when the stage lists
//! the data set again).

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

use crate::dataset::Dataset;
use crate::entry::Owner;
use crate::protocol::{ErrorCode, ProtocolError};
use crate::sync::lock;

/// What a name in a directory is.
pub enum Entry {
    /// A directory: its path in the data set, its owner (listed by a local
    /// data set) and how many directories it holds.
    Dir {
        path: String,
        owner: Option<Owner>,
        subdirs: u32,
    },
    /// A file: its name in the data set and what the listing says of it.
    File(String, Shown),
}

/// What the listing says of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    pub size: u64,
    /// The listing's version of it (see [`crate::entry::FileEntry`]).
    pub version: u64,
    /// A local file's modification time in nanoseconds since 1970
    /// (before it: negative; 0 for an object).
    pub mtime_ns: i64,
    pub owner: Option<Owner>,
}

/// One listing's directories.
#[derive(Debug, Default)]
pub struct Tree {
    /// Per directory path ("" the root): its names sorted, what the
    /// listing says of files (a vector, so that a page of a huge directory
    /// is a slice).
    dirs: HashMap<String, Vec<(String, Option<Shown>)>>,
    /// A local data set's directories' owners.
    owners: HashMap<String, Owner>,
    /// How many directories each directory holding any holds (its link
    /// count is two more, as a local directory's).
    subdirs: HashMap<String, u32>,
    /// Files not shown because a directory has their name (an object store
    /// holds `a` and `a/b`): the directory is shown, whichever was listed
    /// first.
    shadowed: Vec<String>,
}

impl Tree {
    /// The tree of `files`, of the directories `empty` and of the owners
    /// of directories.
    fn new<'a>(
        files: impl Iterator<Item = (&'a str, Shown)>,
        empty: impl Iterator<Item = &'a str>,
        owners: impl Iterator<Item = (&'a str, Owner)>,
    ) -> Self {
        let mut dirs: HashMap<String, BTreeMap<String, Option<Shown>>> = HashMap::new();
        dirs.insert(String::new(), BTreeMap::new());
        let mut shadowed = Vec::new();
        // An empty directory is a path whose last part is a directory too.
        let empty = empty.map(|dir| (dir, None));
        for (name, size) in files.map(|(name, size)| (name, Some(size))).chain(empty) {
            let mut parent = "";
            let mut rest = name;
            while let Some((dir, tail)) = rest.split_once('/') {
                let path = &name[..name.len() - tail.len() - 1];
                let fresh = !dirs.contains_key(path);
                if fresh {
                    dirs.insert(path.to_owned(), BTreeMap::new());
                    let names = dirs.entry(parent.to_owned()).or_default();
                    if let Some(Some(_)) = names.insert(dir.to_owned(), None) {
                        shadowed.push(path.to_owned());
                    }
                }
                parent = path;
                rest = tail;
            }
            if size.is_none() {
                dirs.entry(name.to_owned()).or_default();
            } else if dirs.contains_key(name) {
                shadowed.push(name.to_owned());
                continue;
            }
            let names = dirs.entry(parent.to_owned()).or_default();
            if let Some(Some(_)) = names.insert(rest.to_owned(), size)
                && size.is_none()
            {
                shadowed.push(name.to_owned());
            }
        }
        let subdirs = dirs
            .iter()
            .filter_map(|(path, names)| {
                let n = names.values().filter(|shown| shown.is_none()).count();
                (n > 0).then(|| (path.clone(), u32::try_from(n).unwrap_or(u32::MAX)))
            })
            .collect();
        let dirs = dirs
            .into_iter()
            .map(|(path, names)| (path, names.into_iter().collect()))
            .collect();
        let owners = owners.map(|(path, o)| (path.to_owned(), o)).collect();
        Self {
            dirs,
            owners,
            subdirs,
            shadowed,
        }
    }

    /// Directory `path` as an entry.
    pub fn dir(&self, path: String) -> Entry {
        Entry::Dir {
            owner: self.owners.get(&path).copied(),
            subdirs: self.subdirs.get(&path).copied().unwrap_or(0),
            path,
        }
    }

    /// The entry `name` of directory `path`.
    pub fn entry(&self, path: &str, name: &str) -> Option<Entry> {
        let names = self.dirs.get(path)?;
        let found = names.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok()?;
        let size = names[found].1;
        let full = if path.is_empty() {
            name.to_owned()
        } else {
            format!("{path}/{name}")
        };
        Some(match size {
            None => self.dir(full),
            Some(shown) => Entry::File(full, shown),
        })
    }

    /// The names of directory `path` from the `skip`-th on, sorted, at
    /// most `limit`, each with whether it is a directory: a page costs its
    /// own entries, however large the directory.
    pub fn list(&self, path: &str, skip: usize, limit: usize) -> Vec<(String, bool)> {
        self.dirs.get(path).map_or_else(Vec::new, |names| {
            names
                .get(skip.min(names.len())..)
                .unwrap_or_default()
                .iter()
                .take(limit)
                .map(|(name, size)| (name.clone(), size.is_none()))
                .collect()
        })
    }
}

/// Each data set's tree, for the listing it was built from, and when the
/// source was last asked for a newer listing.
#[derive(Debug, Default)]
pub struct Trees {
    by_dataset: Mutex<HashMap<String, Built>>,
}

thread_local! {
    /// Whether this thread reads the kernel's requests (see
    /// [`answers_the_kernel`]).
    static ANSWERS_KERNEL: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as the one that reads the kernel's requests:
/// a look there never waits for a listing due again, which it starts in
/// the background instead (the requests that would wait are handed to
/// other threads before they start; one whose listing came due
/// meanwhile goes on with the listing it has).
pub fn answers_the_kernel() {
    ANSWERS_KERNEL.set(true);
}

/// How long a look through the mount waits for the data set's listing
/// again when it is due (see [`Trees::list_again_if_due`]).
const FRESH_WAIT: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Built {
    digest: u64,
    tree: Arc<Tree>,
    checked: Instant,
    /// The listing taken again since `checked`, if one was.
    relisting: Option<Arc<Relisting>>,
}

/// A data set being listed again for the mount: every look that finds it
/// in progress waits for it, up to [`FRESH_WAIT`] from its start, not
/// only the look that started it (looks answered at once, as the mount
/// answers them on several threads, found no file added meanwhile).
#[derive(Debug)]
struct Relisting {
    done: Mutex<bool>,
    ended: Condvar,
    until: Instant,
}

impl Relisting {
    fn new() -> Self {
        Self {
            done: Mutex::new(false),
            ended: Condvar::new(),
            until: Instant::now() + FRESH_WAIT,
        }
    }

    /// Whether a look now would wait for it.
    fn holds_looks(&self) -> bool {
        !*lock(&self.done) && Instant::now() < self.until
    }

    fn finish(&self) {
        *lock(&self.done) = true;
        self.ended.notify_all();
    }

    /// Waits until it is done, or its time is up.
    fn wait(&self) {
        let mut done = lock(&self.done);
        while !*done {
            let Some(left) = self.until.checked_duration_since(Instant::now()) else {
                return;
            };
            done = self
                .ended
                .wait_timeout(done, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Trees {
    /// The tree of the data set's listing as the stage has it. As often as
    /// a socket reader's would (5 s, or ten times as long as listing takes:
    /// [`Dataset::refresh_interval`]) the data set is listed again on
    /// `runtime`'s blocking threads, and this call waits for that up to
    /// [`FRESH_WAIT`] (a later call sees a longer one; one on the thread
    /// that [`answers_the_kernel`] does not wait), so that the mount and a
    /// plan over the socket name the same files.
    pub fn of(&self, dataset: &Arc<Dataset>, runtime: &Handle) -> Result<Arc<Tree>, ProtocolError> {
        self.list_again_if_due(dataset, runtime);
        let listing = match dataset.listed() {
            Some(listing) => listing,
            None => dataset.listing().map_err(|e| {
                ProtocolError::new(
                    ErrorCode::IoError,
                    format!("cannot list dataset `{}`: {e}", dataset.name),
                )
            })?,
        };
        if let Some(built) = lock(&self.by_dataset).get(&dataset.name)
            && built.digest == listing.shown_digest
        {
            return Ok(Arc::clone(&built.tree));
        }
        // Built outside the lock: a large listing's tree takes a while,
        // and the other data sets' looks go on meanwhile.
        let files = listing.files.iter().map(|f| {
            let shown = Shown {
                size: f.size,
                version: f.version,
                mtime_ns: f.mtime_ns,
                owner: f.owner,
            };
            (f.name.as_str(), shown)
        });
        let empty = listing.empty_dirs.iter().map(String::as_str);
        let owners = listing.dir_owners.iter().map(|(p, o)| (p.as_str(), *o));
        let tree = Arc::new(Tree::new(files, empty, owners));
        let mut trees = lock(&self.by_dataset);
        match trees.get(&dataset.name) {
            // Another look built it meanwhile.
            Some(built) if built.digest == listing.shown_digest => Ok(Arc::clone(&built.tree)),
            _ => {
                if let Some(first) = tree.shadowed.first() {
                    tracing::warn!(
                        dataset = %dataset.name,
                        files = tree.shadowed.len(),
                        first = %first,
                        "the mount does not show files whose names are also directories (an object `a` beside `a/...`); read them through the socket"
                    );
                }
                let relisting = trees.get(&dataset.name).and_then(|b| b.relisting.clone());
                let built = Built {
                    digest: listing.shown_digest,
                    tree: Arc::clone(&tree),
                    checked: Instant::now(),
                    relisting,
                };
                trees.insert(dataset.name.clone(), built);
                Ok(tree)
            }
        }
    }

    /// Whether [`Trees::of`] may wait for the source now: the data set's
    /// listing is due again, is being taken again, or has never been taken.
    pub fn may_wait(&self, dataset: &Dataset) -> bool {
        match lock(&self.by_dataset).get(&dataset.name) {
            Some(built) => {
                built.relisting.as_ref().is_some_and(|r| r.holds_looks())
                    || built.checked.elapsed() >= dataset.refresh_interval()
            }
            None => dataset.listed().is_none(),
        }
    }

    /// Lists the data set again on `runtime`'s blocking threads when its
    /// tree was last checked a refresh interval ago, and waits for that
    /// listing up to [`FRESH_WAIT`] from its start, as does every look
    /// meanwhile: files added at the source show at the look that follows
    /// their writing (a `glob` right after a job wrote its shards found
    /// none, an `open` of one `ENOENT`), while a source that hangs holds a
    /// look for that long at most, not the mount.
    fn list_again_if_due(&self, dataset: &Arc<Dataset>, runtime: &Handle) {
        let (relisting, started) = {
            let mut trees = lock(&self.by_dataset);
            let Some(built) = trees.get_mut(&dataset.name) else {
                return;
            };
            match &built.relisting {
                Some(relisting) if relisting.holds_looks() => (Arc::clone(relisting), false),
                _ if built.checked.elapsed() < dataset.refresh_interval() => return,
                _ => {
                    built.checked = Instant::now();
                    let relisting = Arc::new(Relisting::new());
                    built.relisting = Some(Arc::clone(&relisting));
                    (relisting, true)
                }
            }
        };
        if started {
            let (dataset, ours) = (Arc::clone(dataset), Arc::clone(&relisting));
            let relist = move || {
                if let Err(e) = dataset.listing() {
                    tracing::warn!(dataset = %dataset.name, error = %e, "cannot list the data set again for the mount");
                }
                ours.finish();
            };
            if let Err((_, why)) = crate::blocking::spawn(runtime, relist) {
                // The tree stands; a later look tries again.
                tracing::warn!(error = %why, "no thread to list a data set again for the mount");
                relisting.finish();
            }
        }
        if !ANSWERS_KERNEL.get() {
            relisting.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_look_waits_for_a_listing_in_progress_until_it_ends_or_its_time_is_up() {
        let relisting = Arc::new(Relisting::new());
        assert!(relisting.holds_looks());
        let looks: Vec<_> = (0..3)
            .map(|_| {
                let relisting = Arc::clone(&relisting);
                std::thread::spawn(move || {
                    let began = Instant::now();
                    relisting.wait();
                    began.elapsed()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        relisting.finish();
        for look in looks {
            let waited = look.join().unwrap();
            assert!(waited >= Duration::from_millis(90), "{waited:?}");
            assert!(
                waited < FRESH_WAIT,
                "woken by the end, not the time: {waited:?}"
            );
        }
        assert!(!relisting.holds_looks());
        // A listing that never ends holds looks until its time is up.
        let hung = Relisting {
            until: Instant::now() + Duration::from_millis(50),
            ..Relisting::new()
        };
        let began = Instant::now();
        hung.wait();
        assert!(began.elapsed() >= Duration::from_millis(45));
        assert!(!hung.holds_looks());
    }

    #[test]
    fn a_file_named_as_a_directory_is_shadowed_whichever_comes_first() {
        let shown = Shown {
            size: 1,
            version: 0,
            mtime_ns: 0,
            owner: None,
        };
        for files in [["a", "a/b", "c"], ["a/b", "a", "c"]] {
            let tree = Tree::new(
                files.into_iter().map(|name| (name, shown)),
                std::iter::empty(),
                std::iter::empty(),
            );
            assert_eq!(
                tree.list("", 0, 10),
                [("a".to_owned(), true), ("c".to_owned(), false)],
                "{files:?}"
            );
            assert_eq!(tree.list("a", 0, 10), [("b".to_owned(), false)]);
            assert_eq!(tree.shadowed, ["a"], "{files:?}");
        }
        // An empty directory shadows a file too.
        let tree = Tree::new(
            [("e", shown)].into_iter(),
            ["e"].into_iter(),
            std::iter::empty(),
        );
        assert_eq!(tree.list("", 0, 10), [("e".to_owned(), true)]);
        assert_eq!(tree.shadowed, ["e"]);
    }

    #[test]
    fn a_listing_becomes_its_directories() {
        let files = [
            ("a/b/1.bin", 1),
            ("a/b/2.bin", 2),
            ("a/3.bin", 3),
            ("top", 4),
        ];
        let shown = |size| Shown {
            size,
            version: 0,
            mtime_ns: 0,
            owner: None,
        };
        let owner = Owner {
            perm: 0o750,
            uid: 7,
            gid: 8,
        };
        let tree = Tree::new(
            files.into_iter().map(|(name, size)| (name, shown(size))),
            ["a/empty", "void"].into_iter(),
            [("a", owner)].into_iter(),
        );
        assert_eq!(
            tree.list("", 0, 10),
            [
                ("a".to_owned(), true),
                ("top".to_owned(), false),
                ("void".to_owned(), true)
            ]
        );
        assert_eq!(
            tree.list("a", 0, 10),
            [
                ("3.bin".to_owned(), false),
                ("b".to_owned(), true),
                ("empty".to_owned(), true)
            ]
        );
        assert_eq!(
            tree.list("a", 1, 10),
            [("b".to_owned(), true), ("empty".to_owned(), true)]
        );
        assert!(tree.list("a/empty", 0, 10).is_empty());
        assert!(
            matches!(tree.entry("a", "empty"), Some(Entry::Dir { path, owner: None, subdirs: 0 }) if path == "a/empty")
        );
        assert_eq!(tree.list("a", 0, 1), [("3.bin".to_owned(), false)]);
        assert!(tree.list("a", 5, 10).is_empty());
        assert!(
            matches!(tree.entry("a/b", "2.bin"), Some(Entry::File(n, s)) if n == "a/b/2.bin" && s.size == 2)
        );
        assert!(
            matches!(tree.entry("", "a"), Some(Entry::Dir { path, owner: Some(o), subdirs: 2 }) if path == "a" && o == owner)
        );
        assert!(matches!(
            tree.dir(String::new()),
            Entry::Dir { subdirs: 2, .. }
        ));
        assert!(matches!(
            tree.entry("a", "b"),
            Some(Entry::Dir { subdirs: 0, .. })
        ));
        assert!(tree.entry("a", "nothing").is_none());
        assert!(tree.list("missing", 0, 10).is_empty());
    }
}
