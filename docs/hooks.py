"""MkDocs hook: the site's front page is the README, with its links into docs/ made
relative to the site, so that the README stays the one front page on GitHub and here."""

from pathlib import Path


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return readme.read_text().replace("](docs/", "](")
