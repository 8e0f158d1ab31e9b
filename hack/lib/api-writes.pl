#!/usr/bin/perl
# API write calls outside the writer (hack/check-layers.sh): prints "file:line: call"
# for each call of a kube `Api` write method (create, replace, patch*, delete*,
# evict, the finalizer helper, an Event recorder's publish) that is not made on the
# writer (`writer.<verb>(` / `.writer.<verb>(`), in the files given. Test code (from
# the first `#[cfg(test)]` on) and comments are left out. The argument count tells
# an Api call from a namesake: `Api::create(pp, obj)` has two arguments where
# `OpenOptions::create(true)` has one, `Api::replace(name, pp, obj)` three where
# `str::replace(from, to)` has two, `Api::delete(name, dp)` two.
use strict;
use warnings;

my %min_args = (
    create => 2, replace => 3, delete => 2, patch => 3,
    patch_status => 1, patch_metadata => 1, patch_scale => 1, patch_approval => 1,
    patch_subresource => 1, replace_status => 1, replace_subresource => 1,
    create_subresource => 1, delete_collection => 1, evict => 1,
);
my $verbs = join '|', sort { length $b <=> length $a } keys %min_args;
my $found = 0;

for my $file (@ARGV) {
    open my $fh, '<', $file or die "$file: $!";
    my $src = do { local $/; <$fh> };
    close $fh;
    $src =~ s/^\s*#\[cfg\(test\)\].*//ms;           # tests at the end of the file
    $src =~ s{//[^\n]*}{ my $c = $&; $c =~ s/[^\n]/ /g; $c }ge;   # comments, lines kept
    $src =~ s{"(?:[^"\\]|\\.)*"}{ my $c = $&; $c =~ s/[^\n]/ /g; "\"$c\"" }ge;
    while ($src =~ /(\w+)?(\s*)\.\s*($verbs)\s*\(/g) {
        my ($recv, $verb, $open) = ($1 // '', $3, pos($src) - 1);
        next if $recv eq 'writer';
        my $args = count_args(\$src, $open);
        next if $args < $min_args{$verb};
        report($file, \$src, $-[0], ".$verb(");
    }
    while ($src =~ /\b(finalizer::finalizer|recorder\s*\.\s*publish|Recorder::new)\s*\(/g) {
        report($file, \$src, $-[0], "$1(");
    }
}
exit($found ? 1 : 0);

sub report {
    my ($file, $src, $at, $what) = @_;
    my $line = 1 + (substr($$src, 0, $at) =~ tr/\n//);
    print "$file:$line: $what\n";
    $found = 1;
}

# Top-level arguments of the call whose `(` is at $open (0 for `()`).
sub count_args {
    my ($src, $open) = @_;
    my ($depth, $commas, $any) = (0, 0, 0);
    for my $i ($open .. length($$src) - 1) {
        my $c = substr($$src, $i, 1);
        if ($c eq '(' || $c eq '[' || $c eq '{') { $depth++; next if $depth == 1; }
        elsif ($c eq ')' || $c eq ']' || $c eq '}') {
            $depth--;
            return $any ? $commas + 1 : 0 if $depth == 0;
        }
        elsif ($c eq ',' && $depth == 1) { $commas++; next; }
        elsif ($c eq '|' && $depth == 1) { }   # closures count as one argument
        $any = 1 if $depth >= 1 && $c !~ /\s/;
    }
    return 0;
}
