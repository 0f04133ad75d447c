# The project's top-level layout has a Snakefile beside workflow/, scripts/ and config/;
# the workflow itself stays in workflow/Snakefile, where the Snakemake catalog and
# snakedeploy look for it. Run from this directory, Snakemake reads this file first.
# The `include:` directive keeps an included file from setting the default target, so
# the workflow's `rule all` would not be it: this call lets it.
workflow.include("workflow/Snakefile", overwrite_default_target=True)
