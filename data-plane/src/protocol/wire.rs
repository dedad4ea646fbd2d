//! Big-endian field encoding shared by every frame: fixed-width integers,
//! `str` (u16 length + UTF-8), `bytes` (u32 length) and `map` (u16 count of
//! string pairs).

use std::collections::BTreeMap;

use super::ProtocolError;

/// Reads fields from a frame payload, refusing anything that runs past its end.
#[derive(Debug)]
pub struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| {
                ProtocolError::bad_frame(format!(
                    "truncated frame: a field needs {n} bytes at offset {} but the payload has {}",
                    self.pos,
                    self.buf.len()
                ))
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    pub fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        self.array().map(u16::from_be_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        self.array().map(u32::from_be_bytes)
    }

    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        self.array().map(u64::from_be_bytes)
    }

    pub fn str(&mut self) -> Result<String, ProtocolError> {
        let len = usize::from(self.u16()?);
        let raw = self.take(len)?;
        let text = std::str::from_utf8(raw)
            .map_err(|_| ProtocolError::bad_frame("a string field is not valid UTF-8"))?;
        if text.contains('\0') {
            return Err(ProtocolError::bad_frame(
                "a string field contains a NUL byte",
            ));
        }
        Ok(text.to_owned())
    }

    /// Reads a `bytes` field (only responses carry them: tests decode those).
    #[cfg(test)]
    pub fn bytes(&mut self) -> Result<&'a [u8], ProtocolError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    pub fn map(&mut self) -> Result<BTreeMap<String, String>, ProtocolError> {
        let count = self.u16()?;
        let mut map = BTreeMap::new();
        for _ in 0..count {
            let key = self.str()?;
            let value = self.str()?;
            if map.insert(key.clone(), value).is_some() {
                return Err(ProtocolError::bad_frame(format!(
                    "label `{key}` appears twice"
                )));
            }
        }
        Ok(map)
    }

    /// Reads a `u32` element count and checks that `count` elements of at
    /// least `min_size` bytes each can fit in what is left of the payload, so
    /// a lying count cannot make the stage allocate.
    pub fn count(&mut self, min_size: usize) -> Result<u32, ProtocolError> {
        let count = self.u32()?;
        let left = self.buf.len() - self.pos;
        if (count as usize).saturating_mul(min_size) > left {
            return Err(ProtocolError::bad_frame(format!(
                "truncated frame: {count} entries announced but only {left} bytes follow"
            )));
        }
        Ok(count)
    }

    /// Checks that the whole payload was consumed.
    pub fn finish(self) -> Result<(), ProtocolError> {
        let left = self.buf.len() - self.pos;
        if left == 0 {
            Ok(())
        } else {
            Err(ProtocolError::bad_frame(format!(
                "{left} bytes left over after the last field"
            )))
        }
    }
}

/// Builds a frame: a 4-byte length placeholder, then fields.
#[derive(Debug, Default)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    /// Starts a frame with room for its length prefix.
    pub fn frame() -> Self {
        Self { buf: vec![0; 4] }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Writes a string, cut at 65535 bytes (on a character boundary).
    pub fn str(&mut self, v: &str) -> &mut Self {
        let mut end = v.len().min(usize::from(u16::MAX));
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.buf.extend_from_slice(&v.as_bytes()[..end]);
        self
    }

    pub fn map(&mut self, map: &BTreeMap<String, String>) -> &mut Self {
        self.u16(map.len() as u16);
        for (k, v) in map {
            self.str(k).str(v);
        }
        self
    }

    /// Takes what has been written so far, leaving the encoder empty.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Fills in the length prefix and returns the whole frame.
    pub fn finish_frame(mut self) -> Vec<u8> {
        let len = (self.buf.len() - 4) as u32;
        self.buf[..4].copy_from_slice(&len.to_be_bytes());
        self.buf
    }
}
