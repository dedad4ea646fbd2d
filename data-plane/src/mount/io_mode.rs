//! How the kernel reads each large file's inode while it is open. It reads
//! an inode one way at a time: through its page cache, which the stage
//! fills, or from a backing file the stage registered (passthrough), and
//! it fails an open of the other way with `EIO` while one is open. So a
//! second open of a planned file (`numpy.load(mmap_mode=...)` opens twice)
//! cannot be passed through, and a planned open of a file passed through
//! cannot go through the page cache: it is passed through too. (Opens
//! that bypass the page cache, `FOPEN_DIRECT_IO`, take neither way; the
//! stage counts those of a large file as through the page cache.)
//!
//! The stage counts the open files of each inode by way, from the moment
//! it decides an open's way until the kernel releases the file, so an
//! open decided while another is being answered sees it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// The way an open file of an inode is read by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// Through the page cache, filled by the stage's answers.
    PageCache,
    /// From the backing file the stage registered for the inode.
    Passthrough,
}

/// The open files of each inode by the way they are read.
#[derive(Debug, Clone, Default)]
pub(super) struct Ways(Arc<Mutex<HashMap<u64, Opens>>>);

#[derive(Debug, Default)]
struct Opens {
    page_cache: usize,
    passthrough: usize,
}

impl Opens {
    fn of(&mut self, way: Way) -> &mut usize {
        match way {
            Way::PageCache => &mut self.page_cache,
            Way::Passthrough => &mut self.passthrough,
        }
    }
}

impl Ways {
    /// Counts an open of `ino` that no plan holds, which is passed through
    /// unless the inode is open through the page cache now.
    pub(super) fn open_unplanned(&self, ino: u64) -> WayHeld {
        self.open(ino, |opens| {
            if opens.page_cache > 0 && opens.passthrough == 0 {
                Way::PageCache
            } else {
                Way::Passthrough
            }
        })
    }

    /// Counts an open of `ino` too small to be passed through: through
    /// the page cache unless the inode is passed through now (a larger
    /// version of the file is open), when it has to be passed through too.
    pub(super) fn open_small(&self, ino: u64) -> WayHeld {
        self.open(ino, |opens| {
            if opens.passthrough > 0 {
                Way::Passthrough
            } else {
                Way::PageCache
            }
        })
    }

    /// Counts an open of `ino` the way `pick` chooses from its open files.
    fn open(&self, ino: u64, pick: impl FnOnce(&Opens) -> Way) -> WayHeld {
        let mut ways = lock(&self.0);
        let opens = ways.entry(ino).or_default();
        let way = pick(opens);
        *opens.of(way) += 1;
        WayHeld {
            ways: self.clone(),
            ino,
            way,
        }
    }

    /// Counts an open of `ino` through the page cache, or `None` when the
    /// inode is passed through now (the open is then to be passed through
    /// too, and counted by [`Ways::open_unplanned`]).
    pub(super) fn open_planned(&self, ino: u64) -> Option<WayHeld> {
        let mut ways = lock(&self.0);
        let opens = ways.entry(ino).or_default();
        if opens.passthrough > 0 {
            return None;
        }
        opens.page_cache += 1;
        Some(WayHeld {
            ways: self.clone(),
            ino,
            way: Way::PageCache,
        })
    }

    /// How many inodes have a counted open file.
    #[cfg(test)]
    fn inodes(&self) -> usize {
        lock(&self.0).len()
    }
}

/// One open file of an inode, counted by its way until dropped (when the
/// kernel releases the file, or the open fails).
#[derive(Debug)]
pub(super) struct WayHeld {
    ways: Ways,
    ino: u64,
    way: Way,
}

impl WayHeld {
    pub(super) fn way(&self) -> Way {
        self.way
    }

    /// The open was to be passed through but goes through the page cache
    /// (the source is not a local directory, or the kernel refused).
    pub(super) fn through_page_cache(&mut self) {
        if self.way == Way::PageCache {
            return;
        }
        let mut ways = lock(&self.ways.0);
        let opens = ways.entry(self.ino).or_default();
        opens.passthrough = opens.passthrough.saturating_sub(1);
        opens.page_cache += 1;
        self.way = Way::PageCache;
    }
}

impl Drop for WayHeld {
    fn drop(&mut self) {
        let mut ways = lock(&self.ways.0);
        if let Some(opens) = ways.get_mut(&self.ino) {
            let n = opens.of(self.way);
            *n = n.saturating_sub(1);
            if opens.page_cache == 0 && opens.passthrough == 0 {
                ways.remove(&self.ino);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_open_takes_the_way_of_the_inodes_open_files() {
        let ways = Ways::default();
        let small = ways.open_small(1);
        assert_eq!(small.way(), Way::PageCache);
        assert_eq!(
            ways.open_unplanned(1).way(),
            Way::PageCache,
            "a file grown large since is not passed through beside it"
        );
        drop(small);
        let large = ways.open_unplanned(1);
        assert_eq!(large.way(), Way::Passthrough);
        assert_eq!(
            ways.open_small(1).way(),
            Way::Passthrough,
            "a file shrunk since is passed through beside the large one"
        );
        drop(large);
        assert_eq!(ways.open_small(1).way(), Way::PageCache);
    }

    #[test]
    fn an_inode_open_one_way_is_opened_that_way_until_its_last_open_goes() {
        let ways = Ways::default();
        let planned = ways.open_planned(1).expect("no open yet");
        let second = ways.open_unplanned(1);
        assert_eq!(
            second.way(),
            Way::PageCache,
            "not passed through beside a planned open"
        );
        drop(planned);
        let third = ways.open_unplanned(1);
        assert_eq!(
            third.way(),
            Way::PageCache,
            "the second open still reads the page cache"
        );
        drop((second, third));
        assert_eq!(
            ways.inodes(),
            0,
            "nothing kept for an inode no one has open"
        );

        let passed = ways.open_unplanned(1);
        assert_eq!(passed.way(), Way::Passthrough);
        assert!(
            ways.open_planned(1).is_none(),
            "a planned open bypasses the page cache"
        );
        assert_eq!(
            ways.open_unplanned(2).way(),
            Way::Passthrough,
            "inodes are apart"
        );
        drop(passed);
        assert!(ways.open_planned(1).is_some());
    }

    #[test]
    fn an_open_not_passed_through_after_all_counts_as_through_the_page_cache() {
        let ways = Ways::default();
        let mut refused = ways.open_unplanned(7);
        refused.through_page_cache();
        assert_eq!(refused.way(), Way::PageCache);
        assert_eq!(ways.open_unplanned(7).way(), Way::PageCache);
        drop(refused);
        assert_eq!(ways.inodes(), 0);
    }
}
