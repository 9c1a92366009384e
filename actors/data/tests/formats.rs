//! The formats users' corpora come in beyond text and JSONL: Parquet files and folders of shards,
//! and `.zst` streams. Detection by name, folder expansion, the documents they give (the same as
//! the same rows as JSONL), SFT conversations from a Parquet `messages` column, and the errors a
//! corrupt or truncated file or a wrong column gets.

use nsactor_data::corpus::{self, Compression, Format};
use nsactor_data::parquet_docs::StringsWriter;
use nsactor_data::prepare::{self, PrepareOptions, PrepareReport};
use nsactor_data::stream;
use nsactor_data::{Message, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn zst(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

/// Documents of every kind a corpus holds: unicode, inner newlines, empty and blank ones.
fn rows(n: usize) -> Vec<String> {
    let c = nsactor_data::bundled_corpus();
    let paras: Vec<&str> = corpus::paragraphs(&c).collect();
    (0..n)
        .map(|i| match i % 11 {
            3 => String::new(),
            7 => "  \n ".into(),
            9 => format!("Ünïcödé {i}: 日本語のテキスト\nand a second line\r\nand a third."),
            _ => paras[i % paras.len()].to_owned(),
        })
        .collect()
}

fn parquet(path: &Path, column: &str, codec: &str, rows: &[Option<&str>], group: usize) -> PathBuf {
    let mut w = StringsWriter::create(path, column, codec).unwrap();
    for g in rows.chunks(group) {
        w.write_group(g).unwrap();
    }
    w.close().unwrap();
    path.to_path_buf()
}

fn jsonl(rows: &[String], field: &str) -> String {
    rows.iter()
        .map(|r| serde_json::json!({ field: r, "id": 7 }).to_string() + "\n")
        .collect()
}

#[test]
fn formats_and_codecs_follow_the_name() {
    let d = |p: &str| corpus::detect(Path::new(p));
    assert_eq!(d("x.parquet"), (Compression::None, Format::Parquet));
    assert_eq!(
        d("data/train-00000-of-00004.PARQUET"),
        (Compression::None, Format::Parquet)
    );
    assert_eq!(d("x.jsonl.zst"), (Compression::Zstd, Format::Jsonl));
    assert_eq!(d("x.txt.zst"), (Compression::Zstd, Format::Text));
    assert_eq!(d("x.json.zst"), (Compression::Zstd, Format::Json));
    assert_eq!(d("x.jsonl.xz"), (Compression::Xz, Format::Jsonl));
    // A compressed Parquet file is no layout of ours: text, which the reader then refuses.
    assert_eq!(d("x.parquet.zst"), (Compression::Zstd, Format::Text));
}

#[test]
fn a_folder_stands_for_its_data_files_in_path_order() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ds");
    for sub in ["data/train", "data/test", ".cache/x"] {
        std::fs::create_dir_all(root.join(sub)).unwrap();
    }
    let one = [Some("a")];
    let names = [
        "data/train/train-00001-of-00002.parquet",
        "data/train/train-00000-of-00002.parquet",
        "data/test/test-00000-of-00001.parquet",
        ".cache/x/stale.parquet",
    ];
    for n in names {
        parquet(&root.join(n), "text", "snappy", &one, 1);
    }
    std::fs::write(root.join("README.md"), "# A dataset").unwrap();
    std::fs::write(root.join("dataset_info.json"), "{}").unwrap();
    let got = corpus::expand(std::slice::from_ref(&root)).unwrap();
    let want: Vec<PathBuf> = [names[2], names[1], names[0]]
        .iter()
        .map(|n| root.join(n))
        .collect();
    assert_eq!(got, want, "Parquet only, sorted, hidden folders skipped");

    // Without Parquet: the text and JSON files, still not the README.
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(plain.join("sub")).unwrap();
    std::fs::write(plain.join("b.jsonl.zst"), zst(b"{\"text\":\"b\"}\n")).unwrap();
    std::fs::write(plain.join("sub/a.txt"), "a\n").unwrap();
    std::fs::write(plain.join("NOTES.md"), "not data").unwrap();
    let got = corpus::expand(&[plain.clone(), root.join("README.md")]).unwrap();
    assert_eq!(
        got,
        [
            plain.join("b.jsonl.zst"),
            plain.join("sub/a.txt"),
            root.join("README.md")
        ],
        "a file named outright is taken whatever its name"
    );
    let docs = stream::read_all_documents(&[plain], "text").unwrap();
    assert_eq!(docs, ["b", "a"]);

    // A folder of `save_to_disk` output: told what to do instead.
    let arrow = dir.path().join("saved");
    std::fs::create_dir_all(&arrow).unwrap();
    std::fs::write(arrow.join("data-00000-of-00001.arrow"), b"ARROW1").unwrap();
    let e = corpus::expand(&[arrow]).unwrap_err().to_string();
    assert!(
        e.contains("saved: no data file") && e.contains("to_parquet"),
        "{e}"
    );
    let e = corpus::expand(&[dir.path().join("nowhere")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nowhere"), "{e}");
}

#[test]
fn parquet_and_zst_give_the_documents_of_the_same_rows_as_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    // Past one batch (4 MB) so that batches join up.
    let rows = rows(40_000);
    let bytes: usize = rows.iter().map(String::len).sum();
    assert!(bytes > 2 * stream::BATCH_BYTES, "{bytes} bytes");
    let some: Vec<Option<&str>> = rows.iter().map(|r| Some(r.as_str())).collect();
    std::fs::write(p("a.jsonl"), jsonl(&rows, "text")).unwrap();
    std::fs::write(p("a.jsonl.zst"), zst(jsonl(&rows, "text").as_bytes())).unwrap();
    let whole = std::fs::read_to_string(p("a.jsonl")).unwrap();
    let want: Vec<String> = corpus::documents(&p("a.jsonl"), &whole, "text")
        .unwrap()
        .into_iter()
        .map(|d| d.into_owned())
        .collect();
    assert_eq!(want.len(), rows.len() - 2 * rows.len().div_ceil(11) + 1);
    for codec in StringsWriter::CODECS {
        let f = parquet(
            &p(&format!("a-{codec}.parquet")),
            "text",
            codec,
            &some,
            4_000,
        );
        let got = stream::read_all_documents(&[f], "text").unwrap();
        assert!(got == want, "{codec}: the Parquet documents differ");
    }
    let got = stream::read_all_documents(&[p("a.jsonl.zst")], "text").unwrap();
    assert!(got == want, "the .jsonl.zst documents differ");

    // Plain text through zstd: the paragraphs of the whole text.
    let text = rows.join("\n\n");
    std::fs::write(p("b.txt.zst"), zst(text.as_bytes())).unwrap();
    let got = stream::read_all_documents(&[p("b.txt.zst")], "text").unwrap();
    let paras: Vec<&str> = corpus::paragraphs(&text).collect();
    assert_eq!(got, paras);

    // Nulls are left out like empty documents.
    let f = parquet(
        &p("n.parquet"),
        "text",
        "zstd",
        &[Some("x"), None, Some("y")],
        2,
    );
    assert_eq!(
        stream::read_all_documents(&[f], "text").unwrap(),
        ["x", "y"]
    );

    // And the shards: byte for byte those of the JSONL file.
    let tok = Tokenizer::bundled();
    let prep = |f: &str, field: &str| {
        let opts = PrepareOptions {
            text_field: field.into(),
            shard_tokens: 400_000,
            ..Default::default()
        };
        prepare::prepare(&tok, &[p(f)], &p(&format!("out-{f}")), &opts).unwrap()
    };
    let (j, q) = (prep("a.jsonl", "text"), prep("a-zstd.parquet", "text"));
    assert!(j.manifest.shards.len() >= 2);
    let sums = |r: &PrepareReport| -> Vec<String> {
        r.manifest.shards.iter().map(|s| s.sha256.clone()).collect()
    };
    assert_eq!(sums(&j), sums(&q));
    assert_eq!(j.manifest.documents, q.manifest.documents);
    assert_eq!(
        q.input_bytes,
        std::fs::metadata(p("a-zstd.parquet")).unwrap().len()
    );
    assert_eq!(q.manifest.text_bytes, bytes as u64);
}

#[test]
fn wrong_columns_and_corrupt_files_get_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let f = parquet(&p("c.parquet"), "content", "snappy", &[Some("hello")], 1);
    let err = |f: &Path, field: &str| {
        stream::read_all_documents(&[f.to_path_buf()], field)
            .unwrap_err()
            .to_string()
    };
    let e = err(&f, "text");
    assert!(
        e.contains("c.parquet: no column `text`")
            && e.contains("`content` (string)")
            && e.contains("--text-column"),
        "{e}"
    );
    assert_eq!(
        stream::read_all_documents(std::slice::from_ref(&f), "content").unwrap(),
        ["hello"]
    );

    // A column that is not a string: an integer, and a list.
    let schema = parquet::schema::parser::parse_message_type(
        "message m { required int64 n; optional group tags (LIST) { repeated group list { optional binary element (UTF8); } } }",
    )
    .unwrap();
    let file = std::fs::File::create(p("n.parquet")).unwrap();
    let props = Arc::new(parquet::file::properties::WriterProperties::builder().build());
    let mut w =
        parquet::file::writer::SerializedFileWriter::new(file, Arc::new(schema), props).unwrap();
    let mut g = w.next_row_group().unwrap();
    let mut c = g.next_column().unwrap().unwrap();
    c.typed::<parquet::data_type::Int64Type>()
        .write_batch(&[5], None, None)
        .unwrap();
    c.close().unwrap();
    let mut c = g.next_column().unwrap().unwrap();
    c.typed::<parquet::data_type::ByteArrayType>()
        .write_batch(&[], Some(&[1]), Some(&[0]))
        .unwrap();
    c.close().unwrap();
    g.close().unwrap();
    w.close().unwrap();
    let e = err(&p("n.parquet"), "n");
    assert!(
        e.contains("column `n` is int64, not a string column"),
        "{e}"
    );
    let e = err(&p("n.parquet"), "tags");
    assert!(e.contains("column `tags` is a nested"), "{e}");

    // Corrupt: not Parquet at all, and a file cut short.
    std::fs::write(p("junk.parquet"), b"PAR1 this is no parquet file PAR1").unwrap();
    let e = err(&p("junk.parquet"), "text");
    assert!(
        e.contains("junk.parquet: not a readable Parquet file"),
        "{e}"
    );
    let whole = std::fs::read(&f).unwrap();
    std::fs::write(p("cut.parquet"), &whole[..whole.len() / 2]).unwrap();
    let e = err(&p("cut.parquet"), "content");
    assert!(
        e.contains("cut.parquet: not a readable Parquet file"),
        "{e}"
    );

    // Pages overwritten with noise, the footer intact: an error naming the file, not a panic.
    let docs = rows(3_000);
    let some: Vec<Option<&str>> = docs.iter().map(|r| Some(r.as_str())).collect();
    let f = parquet(&p("noisy.parquet"), "text", "snappy", &some, 1_000);
    let mut bytes = std::fs::read(&f).unwrap();
    let mut x = 12345u32;
    for b in &mut bytes[4..200_000] {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        *b = (x >> 16) as u8;
    }
    std::fs::write(&f, &bytes).unwrap();
    let tok = Tokenizer::bundled();
    let e = prepare::prepare(&tok, &[f], &p("out"), &PrepareOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("noisy.parquet"), "{e}");

    // A zstd stream cut short, and one that is no zstd.
    let z = zst(jsonl(&rows(2_000), "text").as_bytes());
    std::fs::write(p("cut.jsonl.zst"), &z[..z.len() / 2]).unwrap();
    let e = err(&p("cut.jsonl.zst"), "text");
    assert!(
        e.contains("cannot decompress") && e.contains("cut.jsonl.zst (zstd)"),
        "{e}"
    );
    std::fs::write(p("plain.txt.zst"), "not compressed\n").unwrap();
    let e = err(&p("plain.txt.zst"), "text");
    assert!(e.contains("plain.txt.zst (zstd)"), "{e}");
    // Invalid UTF-8 in a zstd stream: its offset in the decompressed text.
    std::fs::write(p("bad.txt.zst"), zst(b"ok\n\nbad \xff here")).unwrap();
    let e = err(&p("bad.txt.zst"), "text");
    assert!(
        e.contains("bad.txt.zst: invalid UTF-8 at byte offset 8 of the decompressed"),
        "{e}"
    );
}

/// A Parquet file of chat rows as `datasets` writes them: `messages`, a list of
/// `{role, content}` structs (3-level LIST), beside another column.
fn chat_parquet(path: &Path, convs: &[Vec<(&str, &str)>]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    let schema = parquet::schema::parser::parse_message_type(
        "message chat {
           optional binary prompt_id (UTF8);
           optional group messages (LIST) {
             repeated group list {
               optional group element { optional binary content (UTF8); optional binary role (UTF8); }
             }
           }
         }",
    )
    .unwrap();
    let props = Arc::new(parquet::file::properties::WriterProperties::builder().build());
    let file = std::fs::File::create(path).unwrap();
    let mut w =
        parquet::file::writer::SerializedFileWriter::new(file, Arc::new(schema), props).unwrap();
    let mut g = w.next_row_group().unwrap();
    let ids: Vec<ByteArray> = (0..convs.len())
        .map(|i| ByteArray::from(format!("p{i}").as_str()))
        .collect();
    let mut c = g.next_column().unwrap().unwrap();
    c.typed::<ByteArrayType>()
        .write_batch(&ids, Some(&vec![1; convs.len()]), None)
        .unwrap();
    c.close().unwrap();
    for pick in [1, 0] {
        let (mut vals, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
        for conv in convs {
            for (k, m) in conv.iter().enumerate() {
                vals.push(ByteArray::from(if pick == 0 { m.0 } else { m.1 }));
                defs.push(4);
                reps.push(i16::from(k > 0));
            }
        }
        let mut c = g.next_column().unwrap().unwrap();
        c.typed::<ByteArrayType>()
            .write_batch(&vals, Some(&defs), Some(&reps))
            .unwrap();
        c.close().unwrap();
    }
    g.close().unwrap();
    w.close().unwrap();
}

#[test]
fn sft_conversations_read_from_a_parquet_messages_column_as_from_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let convs = vec![
        vec![
            ("system", "Be brief."),
            ("user", "Hi"),
            ("assistant", "Hello."),
        ],
        vec![
            ("user", "2+2?"),
            ("assistant", "4"),
            ("user", "ok"),
            ("assistant", "👍"),
        ],
        vec![("user", "no reply")],
    ];
    let pq = dir.path().join("sft").join("train-00000-of-00001.parquet");
    std::fs::create_dir_all(pq.parent().unwrap()).unwrap();
    chat_parquet(&pq, &convs);
    let lines: String = convs
        .iter()
        .map(|c| {
            let msgs: Vec<_> = c
                .iter()
                .map(|(r, t)| serde_json::json!({ "role": r, "content": t }))
                .collect();
            serde_json::json!({ "messages": msgs }).to_string() + "\n"
        })
        .collect();
    let jl = dir.path().join("sft.jsonl.zst");
    std::fs::write(&jl, zst(lines.as_bytes())).unwrap();
    let from_pq = nsactor_data::sample::read_conversations(&pq, Some("S")).unwrap();
    let from_jl = nsactor_data::sample::read_conversations(&jl, Some("S")).unwrap();
    assert_eq!(from_pq, from_jl);
    assert_eq!(
        from_pq.len(),
        2,
        "the conversation without a reply is left out"
    );
    assert_eq!(from_pq[1][0], Message::new("system", "S"));
    assert_eq!(from_pq[1][4], Message::new("assistant", "👍"));
    // Through a folder, as `train --sft --corpus DIR` passes it.
    let tok = Tokenizer::bundled();
    let (rows, report) = nsactor_data::sample::sft_rows(
        &tok,
        &[dir.path().join("sft")],
        None,
        65,
        nsactor_data::sample::SftOverflow::Keep,
    )
    .unwrap();
    assert_eq!((rows.len(), report.conversations), (2, 2));
}
