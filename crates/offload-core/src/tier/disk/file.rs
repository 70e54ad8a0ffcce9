//! The tier's files: opening them (lock, `O_DIRECT` probe and the kernel's alignment,
//! reserved space), and positional reads and writes, vectored too, with their errors
//! sorted by kind and the faults of a [`FaultPlan`](crate::transfer::FaultPlan) injected
//! (`faults.rs`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::aligned::{AlignedBuf, DioAlign};
use super::error::{DiskError, IoKind};
pub(crate) use super::faults::DiskFaults;
use super::faults::ReadFault;
use super::layout::ALIGN;

/// An I/O that failed, by kind.
pub(crate) fn classify(e: &io::Error) -> IoKind {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => IoKind::NoSpace,
        Some(libc::EIO) => IoKind::Io,
        Some(libc::EINVAL) => IoKind::Invalid,
        _ => IoKind::Other,
    }
}

/// Most iovecs one `preadv` takes on Linux (`UIO_MAXIOV`; libc does not export it).
const IOV_MAX: usize = 1024;

/// The data file: positional I/O, direct where the file system allows it.
#[derive(Debug)]
pub(crate) struct DataFile {
    file: File,
    direct: bool,
    align: DioAlign,
}

impl DataFile {
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    /// What a direct transfer asks of its buffers (meaningful when [`Self::is_direct`]).
    pub(crate) fn align(&self) -> DioAlign {
        self.align
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    pub(crate) fn sync(&self) -> io::Result<()> {
        self.file.sync_all()
    }

    /// The same file opened again for buffered reads and writes, through its descriptor
    /// (`/proc/self/fd`), so it opens whether or not the file still has a name.
    pub(crate) fn reopen(&self) -> io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// Reads `buf.len()` bytes at `offset`; anything less is an error of kind `Short`.
    pub(crate) fn read(
        &self,
        buf: &mut [u8],
        offset: u64,
        faults: &DiskFaults,
    ) -> Result<(), IoKind> {
        let fault = faults.read_fault();
        if matches!(fault, Some(ReadFault::Eio)) {
            return Err(IoKind::Io);
        }
        let n = self.file.read_at(buf, offset).map_err(|e| classify(&e))?;
        if n != buf.len() || matches!(fault, Some(ReadFault::Short)) {
            return Err(IoKind::Short);
        }
        if matches!(fault, Some(ReadFault::Corrupt)) {
            if let Some(b) = buf.get_mut(buf.len() / 2) {
                *b ^= 0x5a;
            }
        }
        Ok(())
    }

    /// Reads `parts`' total length at `offset` into `parts` in order and hands each piece
    /// (of at most `group` bytes) to `arrived` as soon as its bytes are in: the parts are
    /// read about `group` bytes at a time (one `preadv` each, more past
    /// [`IOV_MAX`] pieces), so a caller that sums the pieces reads them while they are in
    /// cache. The faults [`Self::read`] injects apply once per call: anything less than
    /// every byte is an error of kind `Short`, and a corrupt read flips the byte in the
    /// middle of the whole range before `arrived` sees it.
    pub(crate) fn read_parts(
        &self,
        parts: &mut [&mut [u8]],
        offset: u64,
        faults: &DiskFaults,
        group: usize,
        mut arrived: impl FnMut(&[u8]),
    ) -> Result<(), IoKind> {
        let fault = faults.read_fault();
        match fault {
            Some(ReadFault::Eio) => return Err(IoKind::Io),
            Some(ReadFault::Short) => return Err(IoKind::Short),
            _ => {}
        }
        let group = group.max(1);
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut flip = matches!(fault, Some(ReadFault::Corrupt)).then_some(total / 2);
        let mut pieces: Vec<&mut [u8]> =
            parts.iter_mut().flat_map(|p| p.chunks_mut(group)).collect();
        let mut at = offset;
        let mut rest = &mut pieces[..];
        while !rest.is_empty() {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len() && (n == 0 || bytes + rest[n].len() <= group) {
                bytes += rest[n].len();
                n += 1;
            }
            let (now, later) = rest.split_at_mut(n);
            self.read_exact_parts(now, at)?;
            for piece in now.iter_mut() {
                if let Some(i) = flip {
                    match piece.get_mut(i) {
                        Some(b) => {
                            *b ^= 0x5a;
                            flip = None;
                        }
                        None => flip = Some(i - piece.len()),
                    }
                }
                arrived(piece);
            }
            at += bytes as u64;
            rest = later;
        }
        Ok(())
    }

    /// Reads `parts`' total length at `offset` into `parts` in order, `preadv` after
    /// `preadv` until every byte is in; anything less is an error of kind `Short`.
    fn read_exact_parts(&self, parts: &mut [&mut [u8]], offset: u64) -> Result<(), IoKind> {
        let mut iov: Vec<libc::iovec> = parts
            .iter_mut()
            .filter(|p| !p.is_empty())
            .map(|p| libc::iovec {
                iov_base: p.as_mut_ptr().cast(),
                iov_len: p.len(),
            })
            .collect();
        let mut first = 0;
        let mut at = offset;
        while first < iov.len() {
            let batch = &iov[first..iov.len().min(first + IOV_MAX)];
            let Ok(pos) = libc::off_t::try_from(at) else {
                return Err(IoKind::Invalid);
            };
            // SAFETY: every iovec points into a distinct `&mut [u8]` of `parts`, borrowed
            // exclusively for this call, with its length; the count is at most IOV_MAX.
            let n = unsafe {
                libc::preadv(
                    self.file.as_raw_fd(),
                    batch.as_ptr(),
                    batch.len() as libc::c_int,
                    pos,
                )
            };
            let Ok(mut n) = usize::try_from(n) else {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(classify(&e));
            };
            if n == 0 {
                return Err(IoKind::Short);
            }
            at += n as u64;
            // Past the iovecs the read filled; a partly filled one continues where it
            // stopped.
            while n > 0 && first < iov.len() {
                let v = &mut iov[first];
                let step = n.min(v.iov_len);
                // SAFETY: `step` is within the iovec's part, so the pointer stays in it.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(step) }.cast();
                v.iov_len -= step;
                n -= step;
                if v.iov_len == 0 {
                    first += 1;
                }
            }
        }
        Ok(())
    }

    /// Writes all of `buf` at `offset`.
    pub(crate) fn write(&self, buf: &[u8], offset: u64, faults: &DiskFaults) -> Result<(), IoKind> {
        if let Some(e) = faults.write_fault() {
            return Err(classify(&e));
        }
        let n = self.file.write_at(buf, offset).map_err(|e| classify(&e))?;
        if n != buf.len() {
            return Err(IoKind::Short);
        }
        Ok(())
    }

    /// Writes `parts` in order at `offset`, about `group` bytes a `pwritev` (more than one
    /// past [`IOV_MAX`] pieces), handing each piece to `leaving` just before its group is
    /// written: a caller that sums the pieces reads them while the kernel's copy still
    /// finds them in cache. Anything less than every byte is an error of kind `Short`.
    /// The faults [`Self::write`] injects apply once per call.
    pub(crate) fn write_parts(
        &self,
        parts: &[&[u8]],
        offset: u64,
        faults: &DiskFaults,
        group: usize,
        mut leaving: impl FnMut(&[u8]),
    ) -> Result<(), IoKind> {
        if let Some(e) = faults.write_fault() {
            return Err(classify(&e));
        }
        let group = group.max(1);
        let pieces: Vec<&[u8]> = parts
            .iter()
            .flat_map(|p| p.chunks(group))
            .filter(|p| !p.is_empty())
            .collect();
        let mut at = offset;
        let mut rest = &pieces[..];
        while !rest.is_empty() {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len().min(IOV_MAX) && (n == 0 || bytes + rest[n].len() <= group) {
                bytes += rest[n].len();
                n += 1;
            }
            let (now, later) = rest.split_at(n);
            for piece in now {
                leaving(piece);
            }
            self.write_all_parts(now, at)?;
            at += bytes as u64;
            rest = later;
        }
        Ok(())
    }

    /// One `pwritev` of `pieces` (at most [`IOV_MAX`]) at `offset`, retried when
    /// interrupted; a short write is an error of kind `Short`, not resumed: the slot's
    /// entry is then not written, so whatever part of it landed is never served.
    fn write_all_parts(&self, pieces: &[&[u8]], offset: u64) -> Result<(), IoKind> {
        let iov: Vec<libc::iovec> = pieces
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr().cast_mut().cast(),
                iov_len: p.len(),
            })
            .collect();
        let want: usize = pieces.iter().map(|p| p.len()).sum();
        let Ok(pos) = libc::off_t::try_from(offset) else {
            return Err(IoKind::Invalid);
        };
        loop {
            // SAFETY: every iovec points into a `&[u8]` of `pieces`, borrowed for this
            // call, with its length; the kernel only reads them. At most IOV_MAX.
            let n = unsafe {
                libc::pwritev(
                    self.file.as_raw_fd(),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    pos,
                )
            };
            match usize::try_from(n) {
                Ok(n) if n == want => return Ok(()),
                Ok(_) => return Err(IoKind::Short),
                Err(_) => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(classify(&e));
                    }
                }
            }
        }
    }
}

/// The paths of a rank's file set.
#[derive(Debug, Clone)]
pub(crate) struct FileSet {
    pub data: PathBuf,
    pub idx: PathBuf,
}

impl FileSet {
    pub(crate) fn new(rank_path: &Path) -> Self {
        let mut idx = rank_path.as_os_str().to_owned();
        idx.push(".idx");
        Self {
            data: rank_path.to_path_buf(),
            idx: PathBuf::from(idx),
        }
    }

    /// Removes the index file and, when `data_named`, the data file; absent ones are fine.
    pub(crate) fn remove(&self, data_named: bool) {
        let data = data_named.then_some(&self.data);
        for p in data.into_iter().chain([&self.idx]) {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!("kvoffload disk tier: cannot remove {}: {e}", p.display());
                }
            }
        }
    }

    /// Removes the data file's name while it is open, so the kernel frees its reserved
    /// space when the last descriptor closes, however the process ends (a force-killed
    /// worker runs no destructor). Whether the name is gone; a failure is logged and the
    /// file is then removed at shutdown as before.
    pub(crate) fn unlink_data(&self) -> bool {
        match std::fs::remove_file(&self.data) {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "kvoffload disk tier: cannot unlink {} (removed at shutdown instead): {e}",
                    self.data.display()
                );
                false
            }
        }
    }
}

fn open_err(path: &Path) -> impl Fn(io::Error) -> DiskError + '_ {
    move |e| DiskError::Open {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Opens (creating) a file for reading and writing, `O_DIRECT` when `direct`.
fn open_rw(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true);
    #[allow(clippy::suspicious_open_options)]
    o.truncate(false);
    o.mode(0o600);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Takes an exclusive lock on `file` without waiting; another holder is an error that
/// names the path.
pub(crate) fn lock_exclusive(file: &File, path: &Path) -> Result<(), DiskError> {
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(DiskError::Locked {
            path: path.to_path_buf(),
        });
    }
    Err(open_err(path)(e))
}

/// Opens the data file: `O_DIRECT` unless `page_cache`, falling back to buffered I/O
/// where the file system refuses it at open (tmpfs, some network file systems).
/// [`DataFile::checked`] tries a read once the file has its size.
pub(crate) fn open_data(path: &Path, page_cache: bool) -> Result<DataFile, DiskError> {
    if !page_cache {
        match open_rw(path, true) {
            Ok(file) => {
                let align = DioAlign::of(&file);
                return Ok(DataFile {
                    file,
                    direct: true,
                    align,
                });
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => fallback_logged(path),
            Err(e) => return Err(open_err(path)(e)),
        }
    }
    let file = open_rw(path, false).map_err(open_err(path))?;
    Ok(DataFile {
        file,
        direct: false,
        align: DioAlign::PAGE,
    })
}

fn fallback_logged(path: &Path) {
    log::warn!(
        "kvoffload disk tier: {} does not take O_DIRECT; using buffered I/O",
        path.display()
    );
}

impl DataFile {
    /// This file, or (when a direct read of its first page fails) the same file opened
    /// for buffered I/O. Reads only, so a persisted block is never touched.
    pub(crate) fn checked(self, path: &Path) -> Result<Self, DiskError> {
        if !self.direct {
            return Ok(self);
        }
        let mut page = AlignedBuf::new(ALIGN as usize);
        if self
            .read(page.as_mut_slice(), 0, &DiskFaults::default())
            .is_ok()
        {
            return Ok(self);
        }
        fallback_logged(path);
        drop(self);
        let file = open_rw(path, false).map_err(open_err(path))?;
        Ok(Self {
            file,
            direct: false,
            align: DioAlign::PAGE,
        })
    }
}

/// Opens the index file (always buffered: entries are 64 bytes).
pub(crate) fn open_idx(path: &Path) -> Result<File, DiskError> {
    open_rw(path, false).map_err(open_err(path))
}

/// Sets `file` to exactly `len` bytes with all of them allocated, so the tier never runs
/// out of space later (unless the file system lies, which the write path survives).
pub(crate) fn reserve(file: &File, path: &Path, len: u64) -> Result<(), DiskError> {
    file.set_len(len).map_err(open_err(path))?;
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(DiskError::Space {
            path: path.to_path_buf(),
            bytes: len,
            reason: "larger than the file system's offsets".into(),
        });
    };
    // SAFETY: posix_fallocate on a descriptor we own; it touches no memory of ours.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
    if rc != 0 {
        return Err(DiskError::Space {
            path: path.to_path_buf(),
            bytes: len,
            reason: io::Error::from_raw_os_error(rc).to_string(),
        });
    }
    Ok(())
}
