"""Bad messages give one ValueError naming message and part; options in every spelling."""

from __future__ import annotations

import pytest

import mmferry as mf
from mmferry.chat import PartError, SourcePolicy
from mmferry.chat.options import UnknownOptionError


@pytest.fixture(scope="module")
def proc(checkpoint):
    return mf.Processor.from_pretrained(checkpoint.path)


def _msgs(part):
    return [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, part]},
    ]


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "audio", "audio": "a.wav"}, "unknown part type 'audio'"),
        ({"type": "image"}, "has no image"),
        ({"type": "image_url", "image_url": {}}, "has no image"),
        ({"type": "image", "image": "x.png", "fps": 2}, "'fps' is a video option"),
        ({"type": "image", "image": "/no/such/file.png"}, "no such file"),
        ({"type": "video", "video": "v.mp4", "fps": 1, "nframes": 4}, "either fps or nframes"),
        ({"type": "image", "image": "https://example.com/a.png"}, "allowed hosts"),
    ],
)
def test_bad_part_names_message_and_part(proc, part, match):
    with pytest.raises(ValueError, match=f"message 1 part 1: .*{match}") as err:
        proc.apply_chat_template(_msgs(part), tokenize=True, return_dict=True)
    assert isinstance(err.value, PartError)
    assert (err.value.message_index, err.value.part_index) == (1, 1)


def test_template_that_does_not_render(proc, media):
    template = (
        "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "{{ raise_exception('no images here') }}{% endif %}{% endfor %}{% endfor %}"
    )
    msgs = _msgs({"type": "image", "image": media["small"]})
    with pytest.raises(ValueError, match="at message 1 part 1: no images here"):
        proc.apply_chat_template(msgs, chat_template=template)


def test_source_policy_for_a_service(proc, media, tmp_path):
    policy = SourcePolicy(allow_paths=(str(tmp_path),), allow_objects=False, max_bytes=10)
    part = {"type": "image_url", "image_url": {"url": "file://" + media["small_path"]}}
    with pytest.raises(PartError, match="outside the allowed folders") as err:
        proc.apply_chat_template(_msgs(part), tokenize=True, sources=policy)
    assert (err.value.kind, err.value.status) == ("forbidden_path", 403)
    with pytest.raises(PartError, match="not accepted here"):
        proc.apply_chat_template(_msgs({"type": "image", "image": media["small"]}), sources=policy)
    big = tmp_path / "a.png"
    big.write_bytes(b"x" * 11)
    with pytest.raises(PartError, match="over 10 bytes") as err:
        proc.apply_chat_template(_msgs({"type": "image", "path": str(big)}), sources=policy)
    assert err.value.status == 413


def test_folder_without_a_template_names_the_files(tmp_path, checkpoint):
    import shutil

    for name in ("config.json", "preprocessor_config.json", "tokenizer.json"):
        shutil.copy(checkpoint.path / name, tmp_path / name)
    proc = mf.Processor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="chat_template.json, chat_template.jinja"):
        proc.apply_chat_template([{"role": "user", "content": "hi"}])


def test_options_spelled_as_transformers(checkpoint):
    """The spellings set what transformers' processors set from the same keyword arguments."""
    refs, path = checkpoint.refs, checkpoint.path
    kind = "qwen2" if checkpoint.model_type.startswith("qwen2") else "qwen3"
    video_cls = refs.video_processors[kind]
    for kwargs in (
        {"min_pixels": 5000, "max_pixels": 90000},
        {"size": {"shortest_edge": 6000, "longest_edge": 70000}},
        {"max_pixels": 80000, "fps": 1.0, "do_sample_frames": False},
        {"num_frames": 8, "temporal_patch_size": 2, "merge_size": 2},
    ):
        cfg = mf.Processor.from_pretrained(path, **kwargs).config
        image = refs.image_processor.from_pretrained(path, **kwargs)
        video = video_cls.from_pretrained(path, **kwargs)
        assert (cfg.image_min_pixels, cfg.image_max_pixels) == (
            image.size["shortest_edge"],
            image.size["longest_edge"],
        ), kwargs
        # NOTE: Qwen2VLVideoProcessor lets its file's min_pixels / max_pixels win over a `size`
        # argument; mmferry applies `size` to the video limits too, as the argument asks.
        if not ("size" in kwargs and kind == "qwen2"):
            assert (cfg.video_min_pixels, cfg.video_max_pixels) == (
                video.size["shortest_edge"],
                video.size["longest_edge"],
            ), kwargs
        assert cfg.do_sample_frames == video.do_sample_frames
        assert (cfg.fps, cfg.num_frames) == (video.fps, video.num_frames)
    cfg = mf.Processor.from_pretrained(
        path, max_pixels=90000, videos_kwargs={"max_pixels": 50000, "fps": 4}
    ).config
    assert (cfg.image_max_pixels, cfg.video_max_pixels, cfg.fps) == (90000, 50000, 4)
    # Today's names keep working.
    assert (
        mf.Processor.from_pretrained(path, image_max_pixels=70000).config.image_max_pixels == 70000
    )


def test_unknown_option_lists_valid_names():
    with pytest.raises(ValueError, match="max_pixel.*valid names: min_pixels, max_pixels, size"):
        mf.Processor.for_model("qwen3-vl", max_pixel=5)
    with pytest.raises(UnknownOptionError, match="in videos_kwargs"):
        mf.Processor.for_model("qwen2.5-vl", videos_kwargs={"shortest_edge": 5})


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image", "image": "small", "min_pixels": 300_000, "max_pixels": 400_000},
        {"type": "video", "video": "clip", "resized_height": 600, "resized_width": 600},
        {"type": "video", "video": "frames", "min_pixels": 300_000, "max_pixels": 400_000},
    ],
    ids=["image", "video", "frame list"],
)
def test_a_per_item_size_past_the_decode_bound_is_refused(checkpoint, media, part):
    # A per-item budget replaces the checkpoint's, not the bound on what one frame may hold.
    proc = mf.Processor.from_pretrained(checkpoint.path, max_decoded_pixels=200_000)
    key = part["type"]
    part = {**part, key: media[part[key]]}
    with pytest.raises(PartError, match="message 1 part 1 .*more than max_decoded_pixels=200000"):
        proc.apply_chat_template(_msgs(part), tokenize=True, return_dict=True)


def test_a_per_item_size_under_one_patch_is_refused(proc, media):
    # qwen-vl-utils' max-pixels branch has no lower clamp: a budget under one merged patch
    # sizes a side to 0, which would reach the resize.
    part = {"type": "image", "image": media["small"], "min_pixels": 1, "max_pixels": 100}
    with pytest.raises(PartError, match="message 1 part 1 .*size keys give 0x0, under"):
        proc.apply_chat_template(_msgs(part), tokenize=True, return_dict=True)
