//! `/proc/<pid>/mountinfo` (man 5 proc), parsed once for every executor that reads a
//! container's mounts: the attach agent (its exports) and the migration agent (CRIU's
//! external mounts).

/// One line of mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// Path of the mount inside the filesystem it comes from (field 4).
    pub root: String,
    /// Where it is mounted, relative to the reader's root (field 5).
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
}

/// Parses mountinfo text: root and mount point are fields 4 and 5, then optional fields
/// up to `-`, then the filesystem type and source. Octal escapes (`\040`) are decoded.
/// Malformed lines are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            if fields.len() < 5 || fields.len() < sep + 3 {
                return None;
            }
            Some(MountEntry {
                root: unescape(fields[3]),
                mount_point: unescape(fields[4]),
                fs_type: fields[sep + 1].to_owned(),
                source: unescape(fields[sep + 2]),
            })
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_escapes() {
        let text = "36 35 98:0 /mnt/a\\040b /srv/my\\040dir rw,noatime master:1 - ext3 /dev/root rw\n\
                    garbage line\n\
                    40 35 0:5 / /dev rw shared:2 - tmpfs tmpfs rw,size=64k\n";
        assert_eq!(
            parse(text),
            vec![
                MountEntry {
                    root: "/mnt/a b".into(),
                    mount_point: "/srv/my dir".into(),
                    fs_type: "ext3".into(),
                    source: "/dev/root".into(),
                },
                MountEntry {
                    root: "/".into(),
                    mount_point: "/dev".into(),
                    fs_type: "tmpfs".into(),
                    source: "tmpfs".into(),
                },
            ]
        );
    }
}
