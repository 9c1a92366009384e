//! A plugin file looked at before `dlopen` sees it. The dynamic loader maps a library's
//! segments as its program headers describe them; a file cut short (an interrupted copy, a
//! full disk during an upgrade) still opens, and the first touch of a page past its end kills
//! the process with `SIGBUS` before any error can be reported. So an ELF file is parsed first
//! and every loadable segment and the section table must lie inside the file; anything else
//! is refused with the sizes that do not fit. Files of other formats (Mach-O on macOS) are
//! left to the loader.

use nsactor_plugin_api::EngineError;
use object::elf::{ELFCLASS64, FileClass, FileHeader64, PT_LOAD, ProgramHeader64};
use object::read::elf::{FileHeader, ProgramHeader};
use object::{Endianness, pod};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// `\x7fELF`: the four bytes every ELF file starts with.
const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];

/// Checks that `path` can be mapped whole: a readable file, and for an ELF file, every
/// `PT_LOAD` segment's bytes and the section header table inside it. Reads the headers only.
pub fn check_library_file(path: &Path) -> Result<(), EngineError> {
    let shown = path.display();
    let refuse = |why: String| EngineError::Plugin(format!("{shown} cannot be loaded: {why}"));
    let cut = |what: String, end: u64, len: u64| {
        refuse(format!(
            "{what} needs the file's bytes up to {end}, but it has {len}; it was cut short \
             (an interrupted copy or a full disk?): copy the plugin again"
        ))
    };
    let mut file = std::fs::File::open(path).map_err(|e| refuse(format!("{e}")))?;
    let len = file.metadata().map_err(|e| refuse(format!("{e}")))?.len();
    let mut head = [0u8; std::mem::size_of::<FileHeader64<Endianness>>()];
    let got = read_up_to(&mut file, &mut head).map_err(|e| refuse(format!("{e}")))?;
    if got < 5 {
        return Err(refuse(format!(
            "the file has {len} bytes, too short to be a shared library"
        )));
    }
    if head[..4] != ELF_MAGIC {
        // Not ELF: another platform's format, or not a library at all; the loader says which.
        return Ok(());
    }
    if FileClass(head[4]) != ELFCLASS64 {
        return Err(refuse(
            "it is a 32-bit ELF file; nsactor loads 64-bit plugins".into(),
        ));
    }
    if got < head.len() {
        return Err(cut("its ELF header".into(), head.len() as u64, len));
    }
    let (header, _) = pod::from_bytes::<FileHeader64<Endianness>>(&head)
        .map_err(|()| refuse("its ELF header cannot be read".into()))?;
    let endian = header
        .endian()
        .map_err(|e| refuse(format!("its ELF header cannot be read ({e})")))?;
    let shoff = header.e_shoff(endian);
    let sh_end = shoff
        .saturating_add(u64::from(header.e_shnum(endian)) * u64::from(header.e_shentsize(endian)));
    if shoff != 0 && sh_end > len {
        return Err(cut("its section table".into(), sh_end, len));
    }
    let phoff = header.e_phoff(endian);
    let phnum = usize::from(header.e_phnum(endian));
    let entry = std::mem::size_of::<ProgramHeader64<Endianness>>();
    if phnum > 0 && usize::from(header.e_phentsize(endian)) != entry {
        return Err(refuse(format!(
            "its program headers are {} bytes each, not ELF64's {entry}",
            header.e_phentsize(endian)
        )));
    }
    let ph_end = phoff.saturating_add((phnum * entry) as u64);
    if ph_end > len {
        return Err(cut("its program header table".into(), ph_end, len));
    }
    let mut table = vec![0u8; phnum * entry];
    file.seek(SeekFrom::Start(phoff))
        .and_then(|_| file.read_exact(&mut table))
        .map_err(|e| refuse(format!("reading its program headers: {e}")))?;
    let (segments, _) = pod::slice_from_bytes::<ProgramHeader64<Endianness>>(&table, phnum)
        .map_err(|()| refuse("its program headers cannot be read".into()))?;
    for (i, seg) in segments.iter().enumerate() {
        // A segment with no file bytes (all of it zero-filled memory) maps none.
        if seg.p_type(endian) != PT_LOAD || seg.p_filesz(endian) == 0 {
            continue;
        }
        let end = seg.p_offset(endian).saturating_add(seg.p_filesz(endian));
        if end > len {
            return Err(cut(format!("loadable segment {i}"), end, len));
        }
    }
    Ok(())
}

/// Reads into `buf` until it is full or the file ends: the bytes read.
fn read_up_to(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary itself is an ELF file on Linux: whole it passes, cut short it is
    /// refused with the sizes, and a text file is left to the loader.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_library_cut_short_is_refused_before_loading() {
        let me = std::env::current_exe().unwrap();
        check_library_file(&me).unwrap();
        let bytes = std::fs::read(&me).unwrap();
        let dir = std::env::temp_dir().join(format!("nsactor-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for keep in [bytes.len() / 2, bytes.len() - 1, 64, 4] {
            let cut = dir.join(format!("cut-{keep}.so"));
            std::fs::write(&cut, &bytes[..keep]).unwrap();
            let e = check_library_file(&cut).unwrap_err().to_string();
            assert!(
                e.contains("cut short") || e.contains("too short"),
                "{keep} bytes: {e}"
            );
            assert!(e.contains(&cut.display().to_string()), "{e}");
        }
        let text = dir.join("notes.so");
        std::fs::write(&text, b"not a library").unwrap();
        check_library_file(&text).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
